"""The on-disk GGUF cache on tiny models: the config and tokenizer are built on first use, read back
instead of the GGUF, never trusted blindly, never in the way of the GGUF's own errors; weights are never
cached (the entry stays smaller than the file) and what an older version cached of them is swept.

Each test gets its own cache folder (`gguf_cache_dir`). The in-process lru caches are keyed by (real
path, mtime, size) and every tiny model is a fresh file, so they cannot carry results between tests;
they are not cleared, since other modules share the default model's parsed GGUF through them. Reading a
tokenizer back from the disk cache goes through `load_gguf_tokenizer`, which skips the lru cache.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from radixserve.model_loader import (
    get_model_config,
    get_tokenizer,
    gguf_cache,
    gguf_config,
    gguf_tokenizer,
    iterate_weights,
)
from radixserve.model_loader import gguf as gguf_loader

QT = gguf.GGMLQuantizationType
TT = gguf.TokenType

pytestmark = pytest.mark.usefixtures("gguf_cache_dir")


def _forbid_gguf_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of the GGUF itself fail, so a passing load must have come from the cache."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was parsed although the cache should have answered")

    for module in (gguf_config, gguf_tokenizer):
        monkeypatch.setattr(module, "open_gguf", boom)
    monkeypatch.setattr(gguf_tokenizer, "_build_tokenizer", boom)


def _entry(path: Path | str) -> gguf_cache.CacheEntry:
    entry = gguf_cache.cache_entry(str(path))
    assert entry is not None
    return entry


def _entries(gguf_cache_dir: Path) -> list[str]:
    root = gguf_cache_dir / "gguf"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _tree_bytes(folder: str) -> int:
    """Total size of every file under `folder`."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


def _files_named(root: Path, name: str) -> list[Path]:
    return sorted(root.rglob(name)) if root.exists() else []


def _q8(name: str, x: np.ndarray) -> tuple[np.ndarray, QT]:
    return gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0


# A byte-level BPE vocabulary as large as the tiny model's (96): three control tokens, the printable
# ASCII characters "!".."y", the byte alphabet's space, and three merged tokens.
_TOKENS = ["<unk>", "<s>", "</s>", *(chr(c) for c in range(33, 122)), "Ġ", "ab", "cd", "abcd"]
_VOCAB = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": _TOKENS,
    "tokenizer.ggml.token_type": [int(TT.CONTROL)] * 3 + [int(TT.NORMAL)] * (len(_TOKENS) - 3),
    "tokenizer.ggml.merges": ["a b", "c d", "ab cd"],
    "tokenizer.chat_template": "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
}
_TEXTS = ["abcd", "abcd abc dcba", "Hello, world!", "<s>hi</s> x"]



def _get_tokenizer(path: str):
    """get_tokenizer without its per-process lru cache (4 files): these tests load many small files, which would
    evict the session's default-model tokenizer that other tests expect to get back as the same object."""
    from radixserve.model_loader import gguf_tokenizer
    from radixserve.model_loader.chat_template import with_chat_template

    real = os.path.realpath(path)
    stat = os.stat(real)
    return with_chat_template(gguf_tokenizer._tokenizer_cached.__wrapped__(real, stat.st_mtime_ns, stat.st_size), None)

def _tiny_with_vocab(tiny_gguf, monkeypatch: pytest.MonkeyPatch, **fields) -> object:
    """A tiny model whose file also holds a tokenizer (`_VOCAB`): the fixture writes every metadata value that
    is not a number as a string, so its lists are routed to `add_array` while it writes."""
    assert len(_TOKENS) == 96  # the tiny model's vocabulary size
    real = gguf.GGUFWriter.add_string

    def add(self, key: str, value: object) -> None:
        self.add_array(key, value) if isinstance(value, list) else real(self, key, value)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_string", add)
        return tiny_gguf(metadata=_VOCAB, **fields)


def _describe(tok) -> dict:
    return {
        "class": type(tok).__name__, "fast": tok.is_fast, "len": len(tok), "vocab": tok.get_vocab(),
        "ids": [tok.encode(t) for t in _TEXTS], "decoded": [tok.decode(tok.encode(t)) for t in _TEXTS],
        "specials": [tok.all_special_tokens, tok.all_special_ids, tok.bos_token, tok.eos_token],
        "chat": tok.apply_chat_template([{"role": "user", "content": "abcd"}], tokenize=False),
        "name_or_path": tok.name_or_path,
    }  # fmt: skip


def test_first_load_builds_the_cache_and_the_second_reads_it(
    tiny_gguf, monkeypatch, gguf_cache_dir, load_gguf_tokenizer
) -> None:
    m = _tiny_with_vocab(tiny_gguf, monkeypatch, tied=False)
    cold_cfg = get_model_config(str(m.path))
    cold_tok = _describe(_get_tokenizer(str(m.path)))
    assert cold_tok["ids"][0] == [_TOKENS.index("abcd")] and cold_tok["len"] == 96  # the vocabulary is used
    entry = _entry(m.path)
    assert os.path.isfile(entry.file(gguf_cache.CONFIG_FILE))
    assert os.path.isdir(entry.file(gguf_cache.TOKENIZER_DIR))
    assert _entries(gguf_cache_dir) == [os.path.basename(entry.folder)]

    _forbid_gguf_parsing(monkeypatch)
    assert get_model_config(str(m.path)) == cold_cfg
    # The override is applied after the cache, exactly as without it.
    assert get_model_config(str(m.path), context_length=100).context_len == 100
    assert get_model_config(str(m.path), context_length=100) == dataclasses.replace(cold_cfg, context_len=100)
    with pytest.raises(ValueError, match="context length must be positive"):
        get_model_config(str(m.path), context_length=0)
    warm_tok = load_gguf_tokenizer(str(m.path))
    assert _describe(warm_tok) == cold_tok


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


def test_weights_are_never_cached_and_the_entry_stays_smaller_than_the_file(
    tiny_gguf, monkeypatch, gguf_cache_dir
) -> None:
    """Issue: the on-disk cache must never be larger than the file (a float32 copy of a Q8 file is ~4x it)."""
    m = _tiny_with_vocab(tiny_gguf, monkeypatch, encode=_q8, tied=False)
    get_model_config(str(m.path))
    _get_tokenizer(str(m.path))
    cold = list(iterate_weights(str(m.path)))
    assert len(cold) == len(m.hf_weights)
    entry = _entry(m.path)
    assert os.path.isdir(entry.file(gguf_cache.TOKENIZER_DIR)) and os.path.isfile(entry.file(gguf_cache.CONFIG_FILE))
    assert not os.path.exists(entry.file(gguf_cache.LEGACY_WEIGHTS_FILE))
    assert _files_named(gguf_cache_dir, "*.safetensors") == []
    float32_bytes = sum(w.numel() * 4 for _, w in cold)
    assert float32_bytes > os.path.getsize(m.path)  # so a weights cache could not pass the next check
    assert 0 < _tree_bytes(entry.folder) <= os.path.getsize(m.path)
    assert _tree_bytes(str(gguf_cache_dir)) <= os.path.getsize(m.path)
    # The weights come from the file every time, and still the same ones.
    parses: list[str] = []
    real_open = gguf_loader.open_gguf
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda path, **kw: parses.append(path) or real_open(path, **kw))
    again = list(iterate_weights(str(m.path)))
    assert parses
    assert [n for n, _ in again] == [n for n, _ in cold]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(cold, again, strict=True))
    assert _tree_bytes(entry.folder) <= os.path.getsize(m.path)


def test_legacy_weights_files_are_swept_when_an_entry_is_made(tiny_gguf, gguf_cache_dir) -> None:
    a, b = tiny_gguf(tied=False), tiny_gguf(rope_theta=20000.0)
    get_model_config(str(a.path))
    get_model_config(str(b.path))
    entry_a, entry_b = _entry(a.path), _entry(b.path)
    # What CACHE_VERSION 2 would have left: a sound safetensors file of wrong weights, and junk.
    legacy_a = Path(entry_a.file(gguf_cache.LEGACY_WEIGHTS_FILE))
    legacy_b = Path(entry_b.file(gguf_cache.LEGACY_WEIGHTS_FILE))
    safetensors.torch.save_file({name: torch.zeros(w.shape) for name, w in a.hf_weights.items()}, str(legacy_a))
    legacy_b.write_bytes(b"\x00junk" * 1000)
    # Nothing reads them: the weights come from the file.
    present = dict(iterate_weights(str(a.path)))
    for name, w in a.hf_weights.items():
        assert torch.equal(present[name], torch.from_numpy(w)), name
    assert legacy_a.exists() and legacy_b.exists()

    c = tiny_gguf(rope_theta=30000.0)
    get_model_config(str(c.path))  # creates c's entry, sweeping the cache root
    assert not legacy_a.exists() and not legacy_b.exists()
    assert _files_named(gguf_cache_dir, gguf_cache.LEGACY_WEIGHTS_FILE) == []
    # The entries of files that still exist are kept, artefacts and all.
    assert _entries(gguf_cache_dir) == sorted(os.path.basename(_entry(x.path).folder) for x in (a, b, c))
    assert os.path.isfile(entry_a.file(gguf_cache.CONFIG_FILE)) and os.path.isfile(entry_b.file(gguf_cache.CONFIG_FILE))
    cold = dict(iterate_weights(str(a.path)))
    assert cold.keys() == present.keys()
    assert all(torch.equal(cold[name], present[name]) for name in present)


def _bump_mtime(path: Path, seconds: int = 1) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


def _count_gguf_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real_open = gguf_loader.open_gguf

    def spy(path: str, **kwargs: object) -> object:
        calls.append(path)
        return real_open(path, **kwargs)

    for module in (gguf_loader, gguf_config, gguf_tokenizer):  # weights, config, tokenizer: each parses the file
        monkeypatch.setattr(module, "open_gguf", spy)
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


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"hf_config": 3}'])
def test_a_corrupt_config_cache_is_rebuilt(tiny_gguf, monkeypatch, garbage: bytes) -> None:
    m = tiny_gguf()
    cfg = get_model_config(str(m.path))
    Path(_entry(m.path).file(gguf_cache.CONFIG_FILE)).write_bytes(garbage)
    assert get_model_config(str(m.path)) == cfg
    _forbid_gguf_parsing(monkeypatch)
    assert get_model_config(str(m.path)) == cfg


def test_a_damaged_tokenizer_cache_is_rebuilt(tiny_gguf, monkeypatch, load_gguf_tokenizer) -> None:
    m = _tiny_with_vocab(tiny_gguf, monkeypatch)
    cold = _describe(_get_tokenizer(str(m.path)))
    folder = Path(_entry(m.path).file(gguf_cache.TOKENIZER_DIR))
    (folder / "tokenizer.json").write_text("{")
    parses = _count_gguf_parses(monkeypatch)
    assert _describe(load_gguf_tokenizer(str(m.path))) == cold
    assert parses, "a damaged tokenizer cache must not be trusted"
    _forbid_gguf_parsing(monkeypatch)
    assert _describe(load_gguf_tokenizer(str(m.path))) == cold  # and it was saved again


def test_stale_temporaries_are_swept(tiny_gguf, monkeypatch) -> None:
    m = _tiny_with_vocab(tiny_gguf, monkeypatch)
    get_model_config(str(m.path))
    entry = _entry(m.path)
    stale, fresh = Path(entry.folder, ".tmp-crashed.json"), Path(entry.folder, ".tmp-live.json")
    stale_dir = Path(entry.folder, ".tmp-crashed-tokenizer")
    stale_dir.mkdir()
    (stale_dir / "tokenizer.json").write_bytes(b"x" * 100)
    for path in (stale, fresh):
        path.write_bytes(b"x" * 100)
    os.utime(stale, (0, 0))
    os.utime(stale_dir, (0, 0))
    _get_tokenizer(str(m.path))  # a write into the entry tidies it first
    assert os.path.isdir(entry.file(gguf_cache.TOKENIZER_DIR))
    assert not stale.exists() and not stale_dir.exists() and fresh.exists()


def test_disabled_cache_writes_nothing(tiny_gguf, monkeypatch, gguf_cache_dir, load_gguf_tokenizer) -> None:
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "1")
    m = _tiny_with_vocab(tiny_gguf, monkeypatch)
    get_model_config(str(m.path))
    _get_tokenizer(str(m.path))
    list(iterate_weights(str(m.path)))
    assert gguf_cache.cache_entry(str(m.path)) is None
    assert not gguf_cache_dir.exists()
    # ...and ignores what is there: build with the cache on, then read with it off.
    monkeypatch.delenv(gguf_cache.DISABLE_ENV)
    get_model_config(str(m.path))
    load_gguf_tokenizer(str(m.path))
    assert os.path.isdir(_entry(m.path).file(gguf_cache.TOKENIZER_DIR))
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "1")
    parses = _count_gguf_parses(monkeypatch)
    get_model_config(str(m.path))
    assert len(parses) == 1
    load_gguf_tokenizer(str(m.path))
    assert len(parses) == 2


def test_an_unwritable_cache_folder_only_costs_speed(tiny_gguf, monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(blocker))
    m = _tiny_with_vocab(tiny_gguf, monkeypatch)
    assert get_model_config(str(m.path)).architecture == "LlamaForCausalLM"
    assert _get_tokenizer(str(m.path)).encode("abcd") == [_TOKENS.index("abcd")]
    assert len(list(iterate_weights(str(m.path)))) == len(m.hf_weights)
    assert blocker.read_bytes() == b""


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
