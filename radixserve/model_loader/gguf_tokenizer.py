"""Build a fast tokenizer from a GGUF file's own `tokenizer.ggml.*` metadata, for any architecture.

transformers' GGUF loader builds one only for the architectures it models (it refuses e.g. an OLMoE
file before looking at the vocabulary); the vocabulary itself never depends on the architecture. So the
`tokenizers` library is driven directly from the checked metadata (`gguf_vocab`):

- `gpt2`: byte-level BPE from the file's tokens and merges, split as llama.cpp splits for
  `tokenizer.ggml.pre` (`gguf_pretokenizers`), with llama.cpp's `ignore_merges` for Llama 3 vocabularies;
- `llama`: SentencePiece BPE with byte fallback, its merges recovered from the tokens' scores (a GGUF
  stores none), `tokenizer.ggml.add_space_prefix` and `remove_extra_whitespaces` honoured.

Control tokens become special tokens and user-defined ones plain added tokens (both always matched
whole, as llama.cpp does); bos/eos/unk/pad, add_bos/add_eos and the chat template come from the file.
The result is a transformers `PreTrainedTokenizerFast`, so the serving code sees the same object as
for an HF folder. Where a GGUF under-specifies a family's tokenizer, the choice transformers made for
that family is followed (`_FILE_ORDER_MERGES`), so both tokenize alike.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

from radixserve.model_loader import gguf_cache
from radixserve.model_loader.gguf_file import open_gguf
from radixserve.model_loader.gguf_pretokenizers import byte_level_pre_tokenizer, byte_level_split
from radixserve.model_loader.gguf_vocab import MODEL_KEY, PRE_KEY, SPECIAL_ID_KEYS, GGUFVocab, read_gguf_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_SPIECE_SPACE = "\u2581"  # how SentencePiece spells a space inside its pieces

# Families whose SentencePiece scores do not give the merge order, where the order of the tokens in the
# file does (transformers' Gemma converter, checked against Gemma's reference tokenizer).
_FILE_ORDER_MERGES = ("gemma",)


def build_gguf_tokenizer(vocab: GGUFVocab) -> PreTrainedTokenizerFast:
    """The fast tokenizer `vocab` describes (see the module docstring)."""
    if vocab.model == "gpt2":
        backend, add_bos_default = _byte_level_bpe(vocab)
    else:
        backend, add_bos_default = _sentencepiece_bpe(vocab), True  # llama.cpp adds BOS to SPM by default
    _add_file_tokens(backend, vocab)
    return _wrap(backend, vocab, vocab.flags.get("add_bos", add_bos_default))


# --- byte-level BPE -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the spelling of every byte-level vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _byte_level_bpe(vocab: GGUFVocab) -> tuple[Tokenizer, bool]:
    split = byte_level_split(vocab.pre, PRE_KEY)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Regular tokens are stored in the byte alphabet; an added token stored as plain text ("<think>" is,
    # a token with a real space is not) is spelled in it so the model knows every id.
    ids = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
           for i, t in enumerate(vocab.tokens)}
    bpe = models.BPE(vocab=ids, merges=vocab.merges or [], dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, ignore_merges=split.ignore_merges)
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = byte_level_pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    return backend, split.add_bos


# --- SentencePiece BPE ----------------------------------------------------------------------------


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    from transformers.tokenization_utils_base import generate_merges

    # A piece of spaces only is stored with real spaces by some converters (Gemma's); SentencePiece
    # spells spaces as U+2581 inside pieces, and the text is normalised that way below.
    tokens = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    if vocab.architecture.startswith(_FILE_ORDER_MERGES):
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, vocab.scores or ()))
    # The best merge joins two pieces into the best-scored piece (llama.cpp's SPM tokenizer): recovered
    # from the vocabulary by transformers' helper, the same one its SentencePiece converters use.
    merges = vocab.merges or generate_merges(ids, ranks)
    unk = vocab.special_ids.get("unk")
    bpe = models.BPE(vocab=ids, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True,
                     unk_token=tokens[unk] if unk is not None else None)
    backend = Tokenizer(bpe)
    prefix = vocab.flags.get("add_space_prefix", True)  # llama.cpp's default for SentencePiece
    steps: list[normalizers.Normalizer] = []
    if vocab.flags.get("remove_extra_whitespaces", False):
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(r" {2,}"), " ")]
    if prefix:
        # SentencePiece's dummy prefix: a space before the text even when it starts with one, and (as
        # llama.cpp does) before the text after each added token. transformers' Metaspace("first") skips
        # both; sentencepiece itself and llama.cpp do not.
        steps.append(normalizers.Prepend(_SPIECE_SPACE))
    steps.append(normalizers.Replace(" ", _SPIECE_SPACE))
    backend.normalizer = steps[0] if len(steps) == 1 else normalizers.Sequence(steps)
    decode = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(decode)
    return backend


# --- special and added tokens, and the transformers wrapper ---------------------------------------


def _add_file_tokens(backend: Tokenizer, vocab: GGUFVocab) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens: both matched whole in
    the text (llama.cpp's `tokenizer_st_partition`), never cut into pieces by the model."""
    known = backend.get_vocab()
    # In a byte-level vocabulary a "control" token outside the byte alphabet is a converter's mislabel
    # of a regular token; adding it would grow the vocabulary past the model's.
    alphabet = set(_byte_alphabet().values()) if vocab.model == "gpt2" else None
    control = [vocab.tokens[i] for i in vocab.ids_of_type(TokenType.CONTROL)]
    control = [t for t in control if alphabet is None or set(t) <= alphabet]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [vocab.tokens[i] for i in vocab.ids_of_type(TokenType.USER_DEFINED)]
    user = [t for t in user if t in known]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _wrap(backend: Tokenizer, vocab: GGUFVocab, add_bos: bool) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    add_eos = vocab.flags.get("add_eos", False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and name not in vocab.special_ids:
            raise ValueError(f"GGUF file {vocab.path} ({MODEL_KEY} = {vocab.model!r}) adds a {name} token to "
                             f"every prompt but has no {SPECIAL_ID_KEYS[name]}")
    named = {f"{name}_token": vocab.tokens[vocab.special_ids[name]] if name in vocab.special_ids else None
             for name in ("bos", "eos", "unk", "pad")}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, add_bos_token=add_bos, add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) == text, as for an HF folder
        **named,
    )
    if vocab.chat_template:
        tokenizer.chat_template = vocab.chat_template
    return tokenizer


def get_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A fast tokenizer built from the GGUF's vocabulary metadata, with the file's chat template.

    Cached per file, in memory and on disk: recovering a SentencePiece vocabulary's merges takes seconds.
    """
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _tokenizer_cached(real, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _tokenizer_cached(path: str, mtime_ns: int, size: int) -> PreTrainedTokenizerBase:
    entry = gguf_cache.cache_entry(path, size, mtime_ns)
    tokenizer = gguf_cache.load_tokenizer(entry) if entry else None
    if tokenizer is None:
        tokenizer = _build_tokenizer(path)
        if entry:
            gguf_cache.save_tokenizer(entry, tokenizer)
    return tokenizer


def _build_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Built from the file's own `tokenizer.ggml.*` metadata (any architecture; see gguf_tokenizer)."""

    tokenizer = build_gguf_tokenizer(read_gguf_vocab(open_gguf(path)))
    tokenizer.name_or_path = os.path.dirname(path)  # what a cached copy reports too
    return tokenizer
