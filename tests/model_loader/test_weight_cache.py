"""The weight cache (model_loader/weight_cache.py): a second load maps the packed layers the first one wrote, bit
for bit the repack's and with the same logits; a damaged, truncated or lying cache is a miss (logged, rewritten),
never a misread; the cache never holds more than the file; it is off when asked; a write stopped with its process
leaves nothing behind. On the mixed-type tiny model (every exact type, stacked joins, the Python and C++ repacks)
and a tiny MoE model whose experts are packed into their slabs."""

from __future__ import annotations

import json
import logging
import os
import threading

import numpy as np
import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_loader import weight_cache
from radixserve.model_loader.gguf_cache import cache_entry, weight_files
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.model_executor.test_gguf_types_model import SHAPE, TYPES, _encoder
from tests.model_loader.conftest import TinyModel, write_gguf

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_gguf(TinyModel(**SHAPE), tmp_path_factory.mktemp("wc") / "mixed.gguf", _encoder(TYPES)).path


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    from tests.models.moe_models import make_moe_model
    from tests.models.test_moe_gguf import write_moe_gguf

    folder = tmp_path_factory.mktemp("wc-moe")
    model = make_moe_model("olmoe", folder / "hf")
    write_moe_gguf(model, "olmoe", folder / "model.gguf",
                   quant={"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0", "attn_q": "Q8_0"})
    return folder / "model.gguf"


def _runner(path, **kw):
    from radixserve.model_executor.model_runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=1024, max_running_requests=4, **kw))


def _logits(runner) -> list[torch.Tensor]:
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in range(2)]
    out = [hb.run([(r, list(range(10 + 3 * i, 40 + 3 * i))) for i, r in enumerate(rows)], full=False)
           .logits_output.next_token_logits.clone()]
    out += [hb.run([(r, [5 + s]) for r in rows], full=False).logits_output.next_token_logits.clone() for s in range(2)]
    hb.release_all()
    return out


def _packed(model) -> dict[str, list[torch.Tensor]]:
    from radixserve.model_loader.gguf_loader import _layers

    out = {}
    for name, mod in _layers(model):
        p = weight_cache.packed_of(mod)
        if p is not None:
            out[name] = [t for w in (p if isinstance(p, tuple) else (p,)) for t in (w.data, w.d, w.m) if t is not None]
    return out


def _load_twice(path, **kw):
    first = _runner(path, **kw)
    weight_cache.wait_writes()
    return first, _runner(path, **kw)


def _bins(path) -> list[str]:
    return weight_files(cache_entry(str(path)))


@pytest.mark.parametrize("which", ["mixed", "moe"])
def test_a_second_load_maps_what_the_first_packed(which, mixed_file, moe_file, gguf_cache_dir) -> None:
    path = mixed_file if which == "mixed" else moe_file
    first, second = _load_twice(path)
    assert first.quant_report.mapped_bytes == 0
    assert 0 < second.quant_report.mapped_bytes <= second.quant_report.bytes
    assert second.quant_report.counts == first.quant_report.counts
    (bin_path,) = _bins(path)
    entry_bytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(cache_entry(str(path)).folder)
                      for n in ns)
    assert entry_bytes <= os.path.getsize(path)  # the whole entry, config and tokenizer too: never more than the file
    # with room kept for a tokenizer the HTTP process may save after this write (256 bytes a piece)
    assert os.path.getsize(bin_path) <= os.path.getsize(path) - (1 << 16) - 256 * second.model_config.vocab_size
    a, b = _packed(first.model), _packed(second.model)
    assert a.keys() == b.keys()
    mapped = 0
    for name in a:
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a[name], b[name], strict=True)), name
        storages = {t.untyped_storage().nbytes() for t in b[name]}
        mapped += storages == {os.path.getsize(bin_path)}  # views of the one mapped file
    assert mapped >= 1
    if which == "moe":
        assert any(isinstance(m.low_bit, tuple) for m in second.model.modules() if hasattr(m, "low_bit"))
    for x, y in zip(_logits(first), _logits(second), strict=True):
        assert x.isfinite().all() and torch.equal(x, y)


def _flip_middle(bin_path, index_path) -> None:
    with open(bin_path, "r+b") as fh:
        fh.seek(os.path.getsize(bin_path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))


def _truncate(bin_path, index_path) -> None:
    os.truncate(bin_path, os.path.getsize(bin_path) - 4096)


def _lie_about_a_kind(bin_path, index_path) -> None:
    with open(index_path) as fh:
        index = json.load(fh)
    rec = next(iter(index["layers"].values()))
    rec["weights"][0]["kind"] = (rec["weights"][0]["kind"] + 1) % 7  # the digest still names the true one
    with open(index_path, "w") as fh:
        json.dump(index, fh)


def _garbage_index(bin_path, index_path) -> None:
    with open(index_path, "w") as fh:
        fh.write("{not json")


def _offset_past_the_end(bin_path, index_path) -> None:
    """A lying index whose own digest is right (rewritten by hand): an offset outside the file is refused."""
    with open(index_path) as fh:
        index = json.load(fh)
    rec = next(iter(index["layers"].values()))
    rec["weights"][0]["data"][2] = index["bytes"] + 4096
    index["layers_digest"] = weight_cache._digest(index["layers"])
    with open(index_path, "w") as fh:
        json.dump(index, fh)


@pytest.mark.parametrize("damage, reason", [
    (_flip_middle, "checksum mismatch"), (_truncate, "is not the"), (_lie_about_a_kind, "checksum mismatch"),
    (_garbage_index, "unreadable index"), (_offset_past_the_end, "outside the file"),
])
def test_a_damaged_cache_is_a_miss_then_written_again(damage, reason, mixed_file, gguf_cache_dir, caplog) -> None:
    good, _ = _load_twice(mixed_file)
    (bin_path,) = _bins(mixed_file)
    damage(bin_path, bin_path[:-4] + ".json")
    with caplog.at_level(logging.WARNING, logger="radixserve.model_loader.weight_cache"):
        missed = _runner(mixed_file)
    assert missed.quant_report.mapped_bytes == 0
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    for x, y in zip(_logits(good), _logits(missed), strict=True):
        assert torch.equal(x, y)
    weight_cache.wait_writes()
    again = _runner(mixed_file)  # the miss wrote a good cache
    assert again.quant_report.mapped_bytes > 0
    for x, y in zip(_logits(good), _logits(again), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("lie", ["signature", "rows"])
def test_a_layer_of_another_shape_is_repacked_the_rest_mapped(lie, mixed_file, gguf_cache_dir) -> None:
    """A layer whose signature differs from the model's, or whose record names other shapes than the layer's
    kernels read (its record rewritten by hand, digest and all), is not taken: the planner packs it from the
    file."""
    first, _ = _load_twice(mixed_file)
    (bin_path,) = _bins(mixed_file)
    index_path = bin_path[:-4] + ".json"
    with open(index_path) as fh:
        index = json.load(fh)
    name = next(iter(index["layers"]))
    if lie == "signature":
        index["layers"][name]["signature"] = [1, 2]
    else:
        index["layers"][name]["weights"][0]["n"] += 8
    index["layers_digest"] = weight_cache._digest(index["layers"])
    with open(index_path, "w") as fh:
        json.dump(index, fh)
    runner = _runner(mixed_file)
    assert 0 < runner.quant_report.mapped_bytes < runner.quant_report.bytes
    storage = {t.untyped_storage().nbytes() for t in _packed(runner.model)[name]}
    assert storage != {os.path.getsize(bin_path)}  # packed anew
    for x, y in zip(_logits(first), _logits(runner), strict=True):
        assert torch.equal(x, y)


def test_the_budget_keeps_the_largest_layers_and_the_rest_are_repacked(mixed_file, gguf_cache_dir) -> None:
    from radixserve.model_loader.gguf_loader import _layers, load_gguf_low_bit

    runner = _runner(mixed_file, disable_weight_cache=True)
    packed = _packed(runner.model)
    sizes = sorted((sum(weight_cache._aligned(t.numel() * t.element_size()) for t in ts), n) for n, ts in packed.items())
    budget = sizes[-1][0] + sizes[-2][0] + 1  # the two largest fit, nothing else does
    cache = weight_cache.WeightCache.open(str(mixed_file), "auto", (1, 1, 1), (0, 0), 96)
    cache.budget = budget
    cache.save_async(_layers(runner.model)).join(60)
    assert os.path.getsize(cache.bin_path) <= budget
    with open(cache.index_path) as fh:
        assert set(json.load(fh)["layers"]) == {sizes[-1][1], sizes[-2][1]}
    model = type(runner.model)(runner.model_config, runner.parallel_state).to(dtype=runner.act_dtype)
    report = load_gguf_low_bit(model, str(mixed_file), "auto", None, None, cache)
    assert report.mapped_bytes == sum(t.numel() * t.element_size() for _, n in sizes[-2:] for t in packed[n])
    assert report.counts == runner.quant_report.counts
    got = _packed(model)
    for name, ts in packed.items():
        assert all(torch.equal(x, y) for x, y in zip(ts, got[name], strict=True)), name


def test_off_when_asked(mixed_file, gguf_cache_dir, monkeypatch) -> None:
    _runner(mixed_file, disable_weight_cache=True)
    weight_cache.wait_writes()
    assert _bins(mixed_file) == []
    monkeypatch.setenv("RADIXSERVE_NO_GGUF_CACHE", "1")
    _runner(mixed_file)
    weight_cache.wait_writes()
    monkeypatch.delenv("RADIXSERVE_NO_GGUF_CACHE")
    assert _bins(mixed_file) == []


def test_another_mode_replaces_the_files_of_the_first(mixed_file, gguf_cache_dir) -> None:
    """One layout's files per GGUF: an int8 load's cache replaces the auto load's (the entry stays within the
    file's size), and each mode maps only its own."""
    _load_twice(mixed_file)
    (auto_bin,) = _bins(mixed_file)
    _runner(mixed_file, quantization="int8")
    weight_cache.wait_writes()
    (int8_bin,) = _bins(mixed_file)
    assert int8_bin != auto_bin
    assert _runner(mixed_file, quantization="int8").quant_report.mapped_bytes > 0
    assert _runner(mixed_file).quant_report.mapped_bytes == 0


def test_too_little_disk_writes_nothing(mixed_file, gguf_cache_dir, monkeypatch, caplog) -> None:
    monkeypatch.setattr(weight_cache, "MIN_FREE_DISK", 1 << 62)
    with caplog.at_level(logging.WARNING, logger="radixserve.model_loader.weight_cache"):
        _runner(mixed_file)
        weight_cache.wait_writes()
    assert _bins(mixed_file) == [] and "less than" in caplog.text
    assert not [n for n in os.listdir(cache_entry(str(mixed_file)).folder) if n.startswith(".tmp-")]


def test_a_write_stopped_with_its_process_leaves_nothing(mixed_file, gguf_cache_dir) -> None:
    from radixserve.model_loader.gguf_loader import _layers

    runner = _runner(mixed_file, disable_weight_cache=True)
    cache = weight_cache.WeightCache.open(str(mixed_file), "auto", (1, 1, 1), (0, 0), 96)
    chosen = [(n, m, weight_cache.packed_of(m)) for n, m in _layers(runner.model)
              if weight_cache.packed_of(m) is not None]
    stop = threading.Event()
    stop.set()  # abort_writes() before the first tensor
    cache._save(chosen, stop)
    folder = cache_entry(str(mixed_file)).folder
    assert not [n for n in os.listdir(folder) if n.startswith((".tmp-", "weights-"))]


def test_the_digest_sees_every_byte_and_the_precheck_is_taken_only_for_the_same_file(tmp_path) -> None:
    from radixserve.model_loader import weight_check

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (3 << 16) + 5, dtype=np.uint8)
    base = weight_check.digest(data)
    for i in (0, 1 << 16, (3 << 16) + 4):  # the first chunk, another, the tail
        other = data.copy()
        other[i] ^= 1
        assert weight_check.digest(other) != base
    assert weight_check.digest(data[:-1]) != base
    f = tmp_path / "w.bin"
    f.write_bytes(data.tobytes())
    key, got = weight_check.file_digest(str(f))
    assert got == base
    # the load takes the precheck's result for the file it checked, and computes its own for any other
    assert weight_check.start_precheck(str(f)) is not None
    assert weight_check.checked_digest(str(f), key, b"ignored: the precheck checked this file") == base
    weight_check.start_precheck(str(f))
    other_key = (key[0], key[1], key[2], key[3] + 1)  # rewritten since
    assert weight_check.checked_digest(str(f), other_key, data) == base
    assert weight_check.start_precheck(str(tmp_path / "missing.bin")) is None


def test_tensor_parallel_ranks_keep_a_file_each_within_their_share(mixed_file, gguf_cache_dir) -> None:
    """tp 2: each rank packs and caches only its slice, in a file of its own within half of the file's size; a
    second load of each rank maps its own slice, bit for bit."""
    from radixserve.distributed.parallel_state import ParallelState
    from radixserve.model_loader import get_model_config
    from radixserve.model_loader.gguf_loader import _layers, load_gguf_low_bit
    from radixserve.models.registry import get_model_class

    cfg = get_model_config(str(mixed_file))
    first = {}
    for rank in (0, 1):
        model = get_model_class(cfg.architecture)(cfg, ParallelState(tp_rank=rank, tp_size=2))
        cache = weight_cache.WeightCache.open(str(mixed_file), "auto", (2, 1, 1), (rank, 0), 96)
        assert load_gguf_low_bit(model, str(mixed_file), "auto", None, None, cache).mapped_bytes == 0
        first[rank] = _packed(model)
    weight_cache.wait_writes()
    bins = _bins(mixed_file)
    assert len(bins) == 2 and all(os.path.getsize(b) <= os.path.getsize(mixed_file) // 2 for b in bins)
    assert bins[0].rsplit("-", 2)[0] == bins[1].rsplit("-", 2)[0]  # one layout, two ranks
    for rank in (0, 1):
        model = get_model_class(cfg.architecture)(cfg, ParallelState(tp_rank=rank, tp_size=2))
        cache = weight_cache.WeightCache.open(str(mixed_file), "auto", (2, 1, 1), (rank, 0), 96)
        assert load_gguf_low_bit(model, str(mixed_file), "auto", None, None, cache).mapped_bytes > 0
        got = _packed(model)
        assert got.keys() == first[rank].keys() and len(_layers(model)) >= len(got)
        for name, ts in first[rank].items():
            assert all(torch.equal(x, y) for x, y in zip(ts, got[name], strict=True)), (rank, name)
    assert not torch.equal(first[0][next(iter(first[0]))][0], first[1][next(iter(first[1]))][0])
