"""A GGUF file's tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`), read and checked.

Everything the tokenizer builder needs is read here, once, and checked against itself before anything
is built: a missing or mistyped key, arrays of different lengths, a special token id outside the
vocabulary, a merge naming a token the vocabulary lacks are all a ValueError naming the key, so a
truncated or lying file never yields a tokenizer that silently mis-tokenizes. The key names and token
types are llama.cpp's (`gguf.Keys.Tokenizer`, `gguf.TokenType`); nothing here depends on the
architecture, so any architecture's file is read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import TokenType

from radixserve.model_loader.gguf_file import GGUFFile

MODEL_KEY = "tokenizer.ggml.model"
PRE_KEY = "tokenizer.ggml.pre"
TOKENS_KEY = "tokenizer.ggml.tokens"
SCORES_KEY = "tokenizer.ggml.scores"
TYPES_KEY = "tokenizer.ggml.token_type"
MERGES_KEY = "tokenizer.ggml.merges"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# `tokenizer.ggml.model` values built here: byte-level BPE (GPT-2 style) and SentencePiece BPE (llama).
SUPPORTED_MODELS = ("gpt2", "llama")

# Special token ids the tokenizer (or the stop-token list) uses; each is checked to be in the vocabulary.
SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}
_FLAG_KEYS = {
    "add_bos": "tokenizer.ggml.add_bos_token",
    "add_eos": "tokenizer.ggml.add_eos_token",
    "add_space_prefix": "tokenizer.ggml.add_space_prefix",
    "remove_extra_whitespaces": "tokenizer.ggml.remove_extra_whitespaces",
}


@dataclass(frozen=True)
class GGUFVocab:
    """The checked tokenizer metadata of one GGUF file (token ids index `tokens`)."""

    path: str
    architecture: str
    model: str  # `tokenizer.ggml.model`: "gpt2" or "llama"
    pre: str  # `tokenizer.ggml.pre` ("default" when absent, as llama.cpp reads it)
    tokens: list[str]
    scores: list[float] | None
    token_types: list[int] | None
    merges: list[tuple[str, str]] | None
    special_ids: dict[str, int]  # "bos"/"eos"/... -> id, only those the file names
    flags: dict[str, bool]  # "add_bos"/... -> value, only those the file states
    chat_template: str | None

    def ids_of_type(self, token_type: TokenType) -> list[int]:
        """Ids of every token the file marks with `token_type` (none when it has no type array)."""
        return [i for i, t in enumerate(self.token_types or ()) if t == token_type]


def read_gguf_vocab(f: GGUFFile) -> GGUFVocab:
    """Read and check the tokenizer metadata of `f`; ValueError naming the key at the first problem."""
    model = _string(f, MODEL_KEY)
    if model not in SUPPORTED_MODELS:
        raise ValueError(f"GGUF file {f.path}: {MODEL_KEY} = {model!r} is not a tokenizer radixserve builds "
                         f"(supported: {', '.join(SUPPORTED_MODELS)})")
    pre = _string(f, PRE_KEY) if f.has(PRE_KEY) else "default"
    tokens = _array(f, TOKENS_KEY, str)
    if not tokens:
        raise ValueError(f"GGUF file {f.path}: {TOKENS_KEY} is empty")
    scores = _array(f, SCORES_KEY, float, len(tokens)) if f.has(SCORES_KEY) else None
    types = _array(f, TYPES_KEY, int, len(tokens)) if f.has(TYPES_KEY) else None
    if model == "llama" and scores is None:
        raise ValueError(f"GGUF file {f.path}: a SentencePiece ({MODEL_KEY} = 'llama') vocabulary needs "
                         f"{SCORES_KEY}, which is missing")
    merges = None
    if f.has(MERGES_KEY):
        merges = _merges(f, tokens)
    elif model == "gpt2":
        raise ValueError(f"GGUF file {f.path}: a byte-level BPE ({MODEL_KEY} = 'gpt2') vocabulary needs "
                         f"{MERGES_KEY}, which is missing")
    special_ids = {}
    for name, key in SPECIAL_ID_KEYS.items():
        if f.has(key):
            value = f.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
                raise ValueError(f"GGUF file {f.path}: {key} = {value!r} is not a token id "
                                 f"(the vocabulary has {len(tokens)} tokens)")
            special_ids[name] = value
    flags = {}
    for name, key in _FLAG_KEYS.items():
        if f.has(key):
            value = f.get(key)
            if not isinstance(value, bool):
                raise ValueError(f"GGUF file {f.path}: {key} = {value!r} is not a boolean")
            flags[name] = value
    template = _string(f, CHAT_TEMPLATE_KEY) if f.has(CHAT_TEMPLATE_KEY) else None
    return GGUFVocab(f.path, f.architecture, model, pre, tokens, scores, types, merges, special_ids, flags,
                     template or None)


def _string(f: GGUFFile, key: str) -> str:
    value = f.get(key)  # ValueError naming the key when absent
    if not isinstance(value, str):
        raise ValueError(f"GGUF file {f.path}: {key} = {value!r} is not a string")  # noqa: TRY004
    return value


def _array(f: GGUFFile, key: str, kind: type, length: int | None = None) -> list[Any]:
    """Array `key` with elements of `kind` (ints accepted as floats), `length` long when given."""
    value = f.get(key)
    ok = (int, float) if kind is float else kind
    if not isinstance(value, list) or not all(isinstance(v, ok) and not isinstance(v, bool) for v in value):
        raise ValueError(f"GGUF file {f.path}: {key} is not an array of {kind.__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"GGUF file {f.path}: {key} has {len(value)} entries but {TOKENS_KEY} has {length}")
    return value


def _merges(f: GGUFFile, tokens: list[str]) -> list[tuple[str, str]]:
    """The merges as (left, right) pairs; each must split at a space into two tokens whose join is a token.

    llama.cpp splits at the first space after the first character (a merge's left side may itself be a
    space in vocabularies spelled with raw spaces).
    """
    known = set(tokens)
    pairs = []
    for i, merge in enumerate(_array(f, MERGES_KEY, str)):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1:]) if cut > 0 else (merge, "")
        if not left or not right or left not in known or right not in known or left + right not in known:
            raise ValueError(f"GGUF file {f.path}: {MERGES_KEY}[{i}] = {merge!r} does not join two tokens of "
                             f"{TOKENS_KEY} into a third")
        pairs.append((left, right))
    return pairs
