"""llama.cpp tensor names -> Hugging Face parameter names (by an architecture's record in gguf_arch.py), and
undoing llama.cpp's q/k row permutation."""

from __future__ import annotations

import re

import torch

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Tensors that carry no HF parameter: llama.cpp's precomputed Llama-3 RoPE frequency factors, which
# the config loader turns back into `rope_scaling`.
IGNORED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_parameter_name(gguf_name: str, block_names: dict[str, tuple[str, frozenset[str]]]) -> str | None:
    """The HF name for a llama.cpp tensor name under an architecture's `block_names` (gguf_arch.py); None
    for tensors with no HF counterpart.

    Raises ValueError for a name this loader does not understand.
    """
    if gguf_name in IGNORED_TENSORS:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is not None:
        layer, stem, suffix = match.groups()
        entry = block_names.get(stem)
        if entry is not None and suffix in entry[1]:
            return f"model.layers.{int(layer)}.{entry[0]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: no Hugging Face parameter corresponds to it")


def permuted_head_count(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads llama.cpp used when it permuted this tensor's rows (None: not permuted).

    convert_hf_to_gguf permutes q_proj (weight and bias) with the query head count and k_proj with the
    key/value head count, so that its RoPE can rotate adjacent element pairs.
    """
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head row interleaving of a q/k projection weight or bias.

    llama.cpp views each head's rows as (2, head_dim/2) and transposes to (head_dim/2, 2), turning HF's
    "first half / second half" RoPE layout into interleaved pairs. Transposing back restores HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ValueError(
            f"cannot un-permute {rows} rows across {num_heads} heads (need a multiple of 2*heads)"
        )
    rest = weight.shape[1:]
    half_head = rows // num_heads // 2
    return weight.reshape(num_heads, half_head, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()
