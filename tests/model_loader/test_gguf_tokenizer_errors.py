"""Truncated or lying GGUF tokenizer metadata is a ValueError naming the key, nothing is cached for it,
and a good file still loads afterwards."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("gguf_cache_dir")


def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def _good_meta() -> dict[str, Any]:
    """A small byte-level BPE vocabulary: the 256 byte symbols, "hello" built by four merges, " w", a control."""
    tokens = [*_byte_alphabet(), "he", "hel", "hell", "hello", "Ġw", "<|eot|>"]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o", "Ġ w"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def _spm_meta() -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>", "▁a", "b"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 5,
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1], "tokenizer.ggml.bos_token_id": 1}


@pytest.fixture
def write(tmp_path: Path, write_vocab_gguf):
    """`write(name, meta)` -> path of an `olmoe` GGUF holding `meta`."""
    return lambda name, meta: str(write_vocab_gguf(tmp_path / f"{name}.gguf", "olmoe", meta))


def test_the_good_vocabulary_loads(load_gguf_tokenizer, write) -> None:
    tok = load_gguf_tokenizer(write("good", _good_meta()))
    ids = tok.encode("hello world<|eot|>")
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġw", "o", "r", "l", "d", "<|eot|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world" and tok.eos_token == "<|eot|>"


_N = len(_byte_alphabet()) + 6
BAD = {
    "no model": ({"tokenizer.ggml.model": None}, "no metadata key 'tokenizer.ggml.model'"),
    "unknown model": ({"tokenizer.ggml.model": "wordpiece"}, "tokenizer.ggml.model = 'wordpiece' is not a tokenizer"),
    "model not a string": ({"tokenizer.ggml.model": 7}, "tokenizer.ggml.model = 7 is not a string"),
    "unknown pre": ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre = 'mystery' names a pre-tokenizer"),
    "no tokens": ({"tokenizer.ggml.tokens": None}, "no metadata key 'tokenizer.ggml.tokens'"),
    "tokens not strings": ({"tokenizer.ggml.tokens": list(range(_N))}, "tokenizer.ggml.tokens is not an array of str"),
    "merges missing": ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges, which is missing"),
    "merge of unknown tokens": ({"tokenizer.ggml.merges": ["h e", "he zz"]}, r"tokenizer.ggml.merges\[1\] = 'he zz'"),
    "merge without a space": ({"tokenizer.ggml.merges": ["hello"]}, r"tokenizer.ggml.merges\[0\] = 'hello'"),
    "merge result not a token": ({"tokenizer.ggml.merges": ["h h"]}, r"tokenizer.ggml.merges\[0\] = 'h h'"),
    "token types short": ({"tokenizer.ggml.token_type": [1, 1, 3]},
                          f"tokenizer.ggml.token_type has 3 entries but tokenizer.ggml.tokens has {_N}"),
    "token types not ints": ({"tokenizer.ggml.token_type": ["x"] * _N}, "tokenizer.ggml.token_type is not an array"),
    "eos past the vocabulary": ({"tokenizer.ggml.eos_token_id": 10**6},
                                f"tokenizer.ggml.eos_token_id = 1000000 is not a token id .*{_N} tokens"),
    "eot past the vocabulary": ({"tokenizer.ggml.eot_token_id": _N}, "tokenizer.ggml.eot_token_id = "),
    "flag not a boolean": ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token = 'yes' is not"),
    "bos added but unnamed": ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None},
                              "adds a bos token to every prompt but has no tokenizer.ggml.bos_token_id"),
}  # fmt: skip
SPM_BAD = {
    "scores count": ({"tokenizer.ggml.scores": [0.0] * 3},
                     "tokenizer.ggml.scores has 3 entries but tokenizer.ggml.tokens has 5"),
    "scores missing": ({"tokenizer.ggml.scores": None}, "needs tokenizer.ggml.scores, which is missing"),
    "scores not numbers": ({"tokenizer.ggml.scores": ["a"] * 5}, "tokenizer.ggml.scores is not an array of float"),
    "default bos missing": ({"tokenizer.ggml.bos_token_id": None}, "has no tokenizer.ggml.bos_token_id"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*(("gpt2", c) for c in BAD), *(("llama", c) for c in SPM_BAD)],
                         ids=lambda c: f"{c[0]}: {c[1]}")
def test_lying_metadata_is_refused_naming_the_key(load_gguf_tokenizer, write, gguf_cache_dir: Path,
                                                  case) -> None:
    kind, name = case
    change, message = (BAD if kind == "gpt2" else SPM_BAD)[name]
    meta = (_good_meta() if kind == "gpt2" else _spm_meta()) | change
    path = write("bad", meta)
    for _ in range(2):  # the second attempt finds nothing cached by the first
        with pytest.raises(ValueError, match=message):
            load_gguf_tokenizer(path)
    assert not list(gguf_cache_dir.glob("gguf/*/tokenizer"))
    assert load_gguf_tokenizer(write("good", _good_meta())).encode("hello") == [_N - 3]


def test_a_file_cut_inside_the_vocabulary_is_refused(load_gguf_tokenizer, tmp_path: Path, write) -> None:
    data = Path(write("whole", _good_meta())).read_bytes()
    cut = data.index(b"hello") + 2  # inside the token array
    short = tmp_path / "cut.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=re.escape(f"{short} is truncated or not a GGUF file")):
        load_gguf_tokenizer(str(short))
