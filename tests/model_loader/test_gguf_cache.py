"""The on-disk GGUF cache on tiny models: built on first use, read back instead of the GGUF, never trusted
blindly, never in the way of the GGUF's own errors.

Each test gets its own cache folder (`gguf_cache_dir`). The in-process lru caches are keyed by (real
path, mtime, size) and every tiny model is a fresh file, so they cannot carry results between tests;
they are not cleared, since other modules share the default model's parsed GGUF through them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from radixserve.model_loader import get_model_config, get_tokenizer, gguf_cache, iterate_weights
from radixserve.model_loader import gguf as gguf_loader

QT = gguf.GGMLQuantizationType

pytestmark = pytest.mark.usefixtures("gguf_cache_dir")


def _forbid_gguf_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of the GGUF itself fail, so a passing load must have come from the cache."""

    def boom(*args: object) -> None:
        raise AssertionError("the GGUF was parsed although the cache should have answered")

    monkeypatch.setattr(gguf_loader, "open_gguf", boom)
    monkeypatch.setattr(gguf_loader, "_build_tokenizer", boom)


def _entry(path: Path | str) -> gguf_cache.CacheEntry:
    entry = gguf_cache.cache_entry(str(path))
    assert entry is not None
    return entry


def _entries(gguf_cache_dir: Path) -> list[str]:
    root = gguf_cache_dir / "gguf"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _q8(name: str, x: np.ndarray) -> tuple[np.ndarray, QT]:
    return gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0


def test_first_load_builds_the_cache_and_the_second_reads_it(tiny_gguf, monkeypatch, gguf_cache_dir) -> None:
    m = tiny_gguf(encode=_q8, tied=False)
    cold_cfg = get_model_config(str(m.path))
    cold = list(iterate_weights(str(m.path)))
    entry = _entry(m.path)
    assert os.path.isfile(entry.file(gguf_cache.CONFIG_FILE))
    assert os.path.isfile(entry.file(gguf_cache.WEIGHTS_FILE))
    assert _entries(gguf_cache_dir) == [os.path.basename(entry.folder)]

    _forbid_gguf_parsing(monkeypatch)
    assert get_model_config(str(m.path)) == cold_cfg
    # The override is applied after the cache, exactly as without it.
    assert get_model_config(str(m.path), context_length=100).context_len == 100
    assert get_model_config(str(m.path), context_length=100) == dataclasses.replace(cold_cfg, context_len=100)
    with pytest.raises(ValueError, match="context length must be positive"):
        get_model_config(str(m.path), context_length=0)
    warm = list(iterate_weights(str(m.path)))
    assert [name for name, _ in warm] == [name for name, _ in cold]
    for (name, a), (_, b) in zip(cold, warm):
        assert b.dtype == torch.float32 and b.shape == a.shape, name
        assert torch.equal(a, b), name  # bit-identical, q/k un-permutation included
    warm[0][1].add_(1.0)  # yielded tensors belong to the caller: this must not touch the cache
    assert torch.equal(next(iter(iterate_weights(str(m.path))))[1], cold[0][1])


@pytest.mark.parametrize(
    "fields",
    [
        {"arch": "qwen2", "rope_theta": 1e6},
        {"metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                      "llama.rope.scaling.original_context_length": 32768}},
        {"metadata": {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.bos_token_id": None}},
        {"hidden": 64, "heads": 2, "kv_heads": 1, "metadata": {"llama.attention.key_length": 32}},
    ],
)  # fmt: skip
def test_cached_configs_equal_uncached_ones(tiny_gguf, monkeypatch, fields: dict) -> None:
    m = tiny_gguf(**fields)
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "1")
    uncached = get_model_config(str(m.path))
    monkeypatch.delenv(gguf_cache.DISABLE_ENV)
    assert get_model_config(str(m.path)) == uncached  # the miss that fills the cache
    _forbid_gguf_parsing(monkeypatch)
    assert get_model_config(str(m.path)) == uncached


def _bump_mtime(path: Path, seconds: int = 1) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


def _count_gguf_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real_open = gguf_loader.open_gguf

    def spy(path: str) -> object:
        calls.append(path)
        return real_open(path)

    monkeypatch.setattr(gguf_loader, "open_gguf", spy)
    return calls


def test_a_touched_file_misses(tiny_gguf, monkeypatch) -> None:
    m = tiny_gguf()
    cfg = get_model_config(str(m.path))
    old = _entry(m.path)
    _bump_mtime(m.path)
    parses = _count_gguf_parses(monkeypatch)
    assert get_model_config(str(m.path)) == cfg
    assert parses, "a file with a new mtime must be read again"
    assert _entry(m.path).folder != old.folder


def test_a_rewritten_file_misses_and_its_dead_entry_is_swept(tiny_gguf, gguf_cache_dir) -> None:
    m = tiny_gguf()
    before = dict(iterate_weights(str(m.path)))
    assert get_model_config(str(m.path)).rope_theta == 10000.0
    # Same path and size, new weights and config.
    other = tiny_gguf(encode=lambda name, x: (2 * x, QT.F32), rope_theta=20000.0)
    assert os.path.getsize(other.path) == os.path.getsize(m.path)
    m.path.write_bytes(other.path.read_bytes())
    _bump_mtime(m.path)
    assert get_model_config(str(m.path)).rope_theta == 20000.0
    after = dict(iterate_weights(str(m.path)))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(after[name], 2 * before[name])
    # Making the entry for the new contents swept the one for the old.
    assert _entries(gguf_cache_dir) == [os.path.basename(_entry(m.path).folder)]


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _foreign(path: Path) -> None:
    # A sound safetensors file, but not one we wrote: no recorded order, one tensor only.
    safetensors.torch.save_file({"model.norm.weight": torch.zeros(64)}, str(path))


@pytest.mark.parametrize("damage", [_truncate, _foreign])
def test_a_damaged_weights_cache_is_rebuilt(tiny_gguf, monkeypatch, damage) -> None:
    m = tiny_gguf(encode=_q8)
    cold = list(iterate_weights(str(m.path)))
    weights = Path(_entry(m.path).file(gguf_cache.WEIGHTS_FILE))
    size = weights.stat().st_size
    damage(weights)
    parses = _count_gguf_parses(monkeypatch)
    rebuilt = list(iterate_weights(str(m.path)))
    assert parses, "a damaged cache must not be trusted"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(cold, rebuilt, strict=True))
    assert weights.stat().st_size == size  # rewritten whole
    _forbid_gguf_parsing(monkeypatch)
    assert len(list(iterate_weights(str(m.path)))) == len(cold)


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"hf_config": 3}'])
def test_a_corrupt_config_cache_is_rebuilt(tiny_gguf, monkeypatch, garbage: bytes) -> None:
    m = tiny_gguf()
    cfg = get_model_config(str(m.path))
    Path(_entry(m.path).file(gguf_cache.CONFIG_FILE)).write_bytes(garbage)
    assert get_model_config(str(m.path)) == cfg
    _forbid_gguf_parsing(monkeypatch)
    assert get_model_config(str(m.path)) == cfg


def test_an_abandoned_weight_stream_caches_nothing(tiny_gguf, monkeypatch) -> None:
    m = tiny_gguf()
    stream = iterate_weights(str(m.path))
    next(stream)
    next(stream)
    stream.close()  # the consumer stopped half way (or crashed)
    entry = _entry(m.path)
    assert not os.path.exists(entry.file(gguf_cache.WEIGHTS_FILE))
    assert [n for n in os.listdir(entry.folder) if n.startswith(".")] == []  # no temporary left behind
    parses = _count_gguf_parses(monkeypatch)
    list(iterate_weights(str(m.path)))
    assert parses and os.path.isfile(entry.file(gguf_cache.WEIGHTS_FILE))


def test_a_writer_killed_mid_stream_leaves_nothing_that_loads(tiny_gguf, monkeypatch) -> None:
    m = tiny_gguf(encode=_q8)
    # A process that dies after two tensors with no cleanup at all, as in a crash.
    child = "import os, sys; from radixserve.model_loader import iterate_weights as load\n"
    child += "stream = load(sys.argv[1]); next(stream); next(stream); os._exit(3)"
    proc = subprocess.run(
        [sys.executable, "-c", child, str(m.path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    entry = _entry(m.path)
    assert not os.path.exists(entry.file(gguf_cache.WEIGHTS_FILE))
    assert [n for n in os.listdir(entry.folder) if n.startswith(".tmp-")]  # its debris, never read
    parses = _count_gguf_parses(monkeypatch)
    weights = dict(iterate_weights(str(m.path)))
    assert parses and os.path.isfile(entry.file(gguf_cache.WEIGHTS_FILE))
    assert torch.equal(weights["model.norm.weight"], torch.from_numpy(m.hf_weights["model.norm.weight"]))


def test_two_concurrent_builders_leave_one_sound_file(tiny_gguf, monkeypatch) -> None:
    m = tiny_gguf(encode=_q8)
    a, b = iterate_weights(str(m.path)), iterate_weights(str(m.path))
    out_a = [pair_a for pair_a, _ in zip(a, b, strict=True)]  # interleaved, each writing its own temporary
    _forbid_gguf_parsing(monkeypatch)
    warm = list(iterate_weights(str(m.path)))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(out_a, warm, strict=True))
    assert [n for n in os.listdir(_entry(m.path).folder) if n.startswith(".")] == []


def test_stale_temporaries_are_swept(tiny_gguf) -> None:
    m = tiny_gguf()
    get_model_config(str(m.path))
    entry = _entry(m.path)
    stale, fresh = Path(entry.folder, ".tmp-crashed.safetensors"), Path(entry.folder, ".tmp-live.safetensors")
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    os.utime(stale, (0, 0))
    list(iterate_weights(str(m.path)))  # a write into the entry tidies it first
    assert not stale.exists() and fresh.exists()


def test_disabled_cache_writes_nothing(tiny_gguf, monkeypatch, gguf_cache_dir) -> None:
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "1")
    m = tiny_gguf()
    get_model_config(str(m.path))
    list(iterate_weights(str(m.path)))
    assert gguf_cache.cache_entry(str(m.path)) is None
    assert not gguf_cache_dir.exists()
    # ...and ignores what is there: build with the cache on, then read with it off.
    monkeypatch.delenv(gguf_cache.DISABLE_ENV)
    list(iterate_weights(str(m.path)))
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "1")
    parses = _count_gguf_parses(monkeypatch)
    list(iterate_weights(str(m.path)))
    assert parses


def test_weights_are_not_cached_onto_a_nearly_full_disk(tiny_gguf, monkeypatch) -> None:
    m = tiny_gguf()
    one_gib_free = SimpleNamespace(total=1 << 30, used=0, free=1 << 30)
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda path: one_gib_free)
    assert len(list(iterate_weights(str(m.path)))) == len(m.hf_weights)
    assert not os.path.exists(_entry(m.path).file(gguf_cache.WEIGHTS_FILE))


def test_an_unwritable_cache_folder_only_costs_speed(tiny_gguf, monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(blocker))
    m = tiny_gguf()
    assert get_model_config(str(m.path)).architecture == "LlamaForCausalLM"
    assert len(list(iterate_weights(str(m.path)))) == len(m.hf_weights)


def test_gguf_errors_still_raise_and_cache_nothing(tiny_gguf, tmp_path: Path, gguf_cache_dir) -> None:
    bad_arch = tiny_gguf(arch="gpt2")
    bad_type = tiny_gguf(
        encode=lambda name, x: (x.astype(np.int8), QT.I8) if "embed" in name else (x, QT.F32)
    )
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf().path.read_bytes()[:300])
    for _ in range(2):  # the second attempt must not find anything cached by the first
        with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
            get_model_config(str(bad_arch.path))
        with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
            iterate_weights(str(bad_arch.path))
        with pytest.raises(ValueError, match="'token_embd.weight'.*unsupported type I8"):
            iterate_weights(str(bad_type.path))
        for load in (get_model_config, iterate_weights, get_tokenizer):
            with pytest.raises(ValueError, match="is truncated or not a GGUF file"):
                load(str(cut))
    assert _entries(gguf_cache_dir) == []


def test_a_cached_file_truncated_later_raises(tiny_gguf) -> None:
    m = tiny_gguf()
    get_model_config(str(m.path))
    list(iterate_weights(str(m.path)))
    m.path.write_bytes(m.path.read_bytes()[:-100])  # new size and mtime: the cache cannot answer
    with pytest.raises(ValueError, match="is truncated or not a GGUF file"):
        get_model_config(str(m.path))
    with pytest.raises(ValueError, match="is truncated or not a GGUF file"):
        iterate_weights(str(m.path))
