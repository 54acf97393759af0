"""The on-disk GGUF cache on the default model, end to end: a fresh process reads the config and tokenizer
back, computes the same weights from the file, and the entry is never larger than the file.

The cache folder is the test's own (`gguf_cache_dir`). The tokenizer's lru cache would answer from
memory, so these tests call the wrapped function (`__wrapped__`) to exercise the disk cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.model_loader import get_model_config, gguf_cache, iterate_weights
from radixserve.model_loader import gguf_tokenizer as gguf_loader

pytestmark = pytest.mark.usefixtures("gguf_cache_dir")


def _entry(path: str) -> gguf_cache.CacheEntry:
    entry = gguf_cache.cache_entry(path)
    assert entry is not None
    return entry


def _tree_bytes(folder: str) -> int:
    """Total size of every file under `folder`."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


def _assert_no_weights_and_smaller_than_the_file(entry: gguf_cache.CacheEntry, model_path: str) -> None:
    """Issue: the on-disk cache must never be larger than the file."""
    assert not os.path.exists(entry.file(gguf_cache.LEGACY_WEIGHTS_FILE))
    names = [n for _, _, files in os.walk(entry.folder) for n in files]
    assert not [n for n in names if n.endswith(".safetensors")], names
    assert 0 < _tree_bytes(entry.folder) <= os.path.getsize(model_path)


# Run both here and in a fresh process, so both sides describe the tokenizer and weights identically.
_PROBE = r"""
import hashlib

TEXTS = [
    "Hello world",
    "  leading spaces, trailing\n\nnewlines\n",
    "Unicode: naïve café, 日本語, emoji 🤖🎉",
    "Code: def f(x):\n\treturn x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]


def describe_tokenizer(tok):
    chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return {
        "class": type(tok).__name__, "is_fast": tok.is_fast, "len": len(tok),
        "ids": [tok.encode(t) for t in TEXTS],
        "ids_with_specials": [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS],
        "decoded": [tok.decode(tok.encode(t)) for t in TEXTS],
        "specials": [tok.all_special_tokens, tok.all_special_ids],
        "named": [[t, getattr(tok, t + "_token"), getattr(tok, t + "_token_id")] for t in ("bos", "eos", "pad", "unk")],
        "added": sorted([k, str(v)] for k, v in tok.added_tokens_decoder.items()),
        "chat_template": tok.chat_template, "chat": chat, "chat_ids": tok.encode(chat),
        "name_or_path": tok.name_or_path,
    }


def describe_weights(stream):
    return [[name, list(w.shape), str(w.dtype), hashlib.sha256(w.contiguous().numpy().data).hexdigest()]
            for name, w in stream]
"""  # fmt: skip

_WARM_CHILD = r"""
import dataclasses, json, sys
import radixserve.model_loader.gguf_config as gc
import radixserve.model_loader.gguf_tokenizer as gt

def boom(*args, **kwargs):
    raise AssertionError("the warm process parsed the GGUF")

gc.open_gguf = gt.open_gguf = gt._build_tokenizer = boom  # the config and the tokenizer come from the cache
from radixserve.model_loader import get_model_config, get_tokenizer, iterate_weights

exec(sys.argv[2])
path = sys.argv[1]
out = {
    "config": dataclasses.asdict(get_model_config(path)),
    "short": get_model_config(path, context_length=1024).context_len,
    "tokenizer": describe_tokenizer(get_tokenizer(path)),
}
# the weights are never cached: they are always computed from the file (gguf.py's open_gguf, not patched)
out["weights"] = describe_weights(iterate_weights(path))
print(json.dumps(out))
"""


def test_default_model_round_trips_through_a_fresh_process(
    default_model_path: str, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe: dict = {}
    exec(_PROBE, probe)  # noqa: S102
    # Cold, into the empty cache. The tokenizer "build" hands back the session's tokenizer, which the
    # same code built from this GGUF: a second real build would re-parse the file (~10 s).
    builds: list[str] = []
    monkeypatch.setattr(gguf_loader, "_build_tokenizer", lambda path: builds.append(path) or tokenizer)
    real, stat = os.path.realpath(default_model_path), os.stat(default_model_path)
    assert gguf_loader._tokenizer_cached.__wrapped__(real, stat.st_mtime_ns, stat.st_size) is tokenizer
    assert builds == [real]
    cold_cfg = get_model_config(default_model_path)
    cold_weights = probe["describe_weights"](iterate_weights(default_model_path))
    entry = _entry(default_model_path)
    for artefact in (gguf_cache.CONFIG_FILE, gguf_cache.TOKENIZER_DIR):
        assert os.path.exists(entry.file(artefact)), artefact

    # Warm, in a fresh process that is not allowed to touch the GGUF.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", _WARM_CHILD, default_model_path, _PROBE],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm = json.loads(proc.stdout.strip().splitlines()[-1])

    assert warm["config"] == json.loads(json.dumps(dataclasses.asdict(cold_cfg)))
    assert warm["short"] == 1024
    expected = probe["describe_tokenizer"](tokenizer)
    assert warm["tokenizer"] == json.loads(json.dumps(expected))
    assert expected["ids"][0] == [19556, 905] and expected["ids"][-1] == [1, 4093, 198, 6004, 2, 198]
    assert expected["ids_with_specials"] == expected["ids"]  # no BOS is added
    assert expected["named"][1][1:] == ["<|im_end|>", 2]
    assert "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n" in expected["chat"]
    assert warm["weights"] == cold_weights  # names, order, shapes, dtype and every bit


def test_default_model_entry_is_never_larger_than_the_file(
    default_model_path: str, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue: the on-disk cache must never be larger than the file. After everything a load asks for (config,
    tokenizer, every weight), the entry holds no weights and fewer bytes than the GGUF."""
    monkeypatch.setattr(gguf_loader, "_build_tokenizer", lambda path: tokenizer)  # built from this GGUF
    real, stat = os.path.realpath(default_model_path), os.stat(default_model_path)
    gguf_loader._tokenizer_cached.__wrapped__(real, stat.st_mtime_ns, stat.st_size)
    get_model_config(default_model_path)
    n_weights = sum(1 for _ in iterate_weights(default_model_path))
    assert n_weights > 0
    entry = _entry(default_model_path)
    assert os.path.isfile(entry.file(gguf_cache.CONFIG_FILE))
    assert os.path.isfile(os.path.join(entry.file(gguf_cache.TOKENIZER_DIR), "tokenizer.json"))
    _assert_no_weights_and_smaller_than_the_file(entry, default_model_path)


def test_a_corrupt_tokenizer_cache_is_rebuilt(default_model_path: str, tokenizer, monkeypatch) -> None:
    builds: list[str] = []
    monkeypatch.setattr(gguf_loader, "_build_tokenizer", lambda path: builds.append(path) or tokenizer)
    real, stat = os.path.realpath(default_model_path), os.stat(default_model_path)

    def load() -> object:
        return gguf_loader._tokenizer_cached.__wrapped__(real, stat.st_mtime_ns, stat.st_size)

    load()
    folder = Path(_entry(default_model_path).file(gguf_cache.TOKENIZER_DIR))
    assert load() is not tokenizer and len(builds) == 1  # read back from the cache
    (folder / "tokenizer.json").write_text("{")
    assert load() is tokenizer and len(builds) == 2  # damaged: rebuilt, not trusted
    assert load().encode("Hello world") == [19556, 905] and len(builds) == 2  # and re-cached
    # A class record naming anything outside transformers is refused rather than imported.
    (folder / "radixserve_class.json").write_text(json.dumps(["os", "system"]))
    assert load() is tokenizer and len(builds) == 3
