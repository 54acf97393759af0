"""How a byte-level BPE GGUF splits text before merging: `tokenizer.ggml.pre` -> llama.cpp's split regexes.

A GGUF carries no tokenizer.json, only the name of its pre-tokenizer. llama.cpp (`llama-vocab.cpp`,
`llm_tokenizer_bpe`) maps each name to a list of regexes applied one after another, every match and
every gap between matches becoming its own piece; `tokenizers` does the same with a sequence of
`Split(..., behavior="isolated")`. Where llama.cpp rewrote a tokenizer.json regex for its own engine
(`(?i:'s|...)` spelled `'[sS]|...`), the original is used: the library's Oniguruma engine reads it.
A name not listed here is refused by `byte_level_split`, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# GPT-2's own regex (OpenAI's encoder.py); most older BPE vocabularies were learned on these pieces.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CHATGLM4 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class ByteLevelSplit:
    """One llama.cpp pre-tokenizer: its regexes in order, and the flags llama.cpp ties to it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole, before any merge
    add_bos: bool = False  # llama.cpp's default when the file has no `tokenizer.ggml.add_bos_token`


_GPT2_SPLIT = ByteLevelSplit((_GPT2,))
_DIGITS_THEN_GPT2 = ByteLevelSplit((r"\p{N}", _GPT2))  # StarCoder-style vocabularies: one digit per token
_LLAMA3_SPLIT = ByteLevelSplit((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_SPLIT = ByteLevelSplit((_QWEN2,))

# llama.cpp's "default" (also what a file without the key gets): its own four-pass split, kept as is
# so a file tokenizes here as it does there.
_DEFAULT_SPLIT = ByteLevelSplit((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

BYTE_LEVEL_SPLITS: dict[str, ByteLevelSplit] = {
    "default": _DEFAULT_SPLIT,
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion", "granite-docling"), _GPT2_SPLIT),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"),
                    _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ByteLevelSplit((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan", "grok-2"), _QWEN2_SPLIT),
    "falcon": ByteLevelSplit((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("glm4", "chatglm-bpe"), ByteLevelSplit((_CHATGLM4,))),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), ByteLevelSplit((_PORO,))),
    "viking": ByteLevelSplit((_PORO, r"\p{N}")),
    "tekken": ByteLevelSplit((_TEKKEN,)),
    **dict.fromkeys(("gpt-4o", "minimax-m2"), ByteLevelSplit((_GPT4O,))),
}


def byte_level_split(pre: str, key: str) -> ByteLevelSplit:
    """The split for pre-tokenizer name `pre` (read from metadata `key`); ValueError naming both when unknown."""
    split = BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        raise ValueError(f"GGUF metadata {key} = {pre!r} names a pre-tokenizer radixserve does not know "
                         f"(known: {', '.join(sorted(BYTE_LEVEL_SPLITS))})")
    return split


def byte_level_pre_tokenizer(split: ByteLevelSplit) -> pre_tokenizers.PreTokenizer:
    """The regex passes, then the byte-to-unicode mapping the vocabulary is spelled in (no regex of its own)."""
    passes: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.regexes
    ]
    passes.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(passes)
