"""The 8-bit KV cache (--kv-cache-dtype int8): llama.cpp's q8_0 blocks, as the C++ kernels read them in place.

A layer's K (or V) buffer is int8 [slots, kv_heads, head_dim / 32 * 34]: each row of head_dim values is blocks of
34 bytes, a float16 scale d then 32 int8 values q (value = d * q; 8.5 bits a value, ggml's block_q8_0). The
kernels (kernels/cpu/csrc/kv_q8.h) address it as [slots, kv_heads, head_dim] values; the PyTorch writer here
computes the same bits as their store_row_q8 (ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(x / d) half
away from zero, d rounded to float16 to nearest even), so a K/V row is identical whichever path wrote it.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32
Q8_BYTES = 34  # a float16 scale + 32 int8 values

# The KV dtypes a pool stores, by their --kv-cache-dtype name ("int8": q8_0 blocks in an int8 tensor)
KV_INT8 = torch.int8


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one (slot, kv head) row of head_dim values."""
    if head_dim % Q8_BLOCK:
        raise ValueError(f"kv_cache_dtype int8 needs a head_dim that is a multiple of {Q8_BLOCK}, got {head_dim}")
    return head_dim // Q8_BLOCK * Q8_BYTES


def kv_bytes_per_value(dtype: torch.dtype) -> float:
    """Bytes one K or V value takes in a pool of this dtype (q8_0: 34 bytes per 32 values)."""
    return Q8_BYTES / Q8_BLOCK if dtype == KV_INT8 else torch.finfo(dtype).bits / 8


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D / 32 * 34] int8 q8_0 blocks."""
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = blocks * inv
    t = torch.trunc(v)  # std::round: half away from zero (torch.round rounds half to even)
    q = t + torch.sign(v) * ((v - t).abs() >= 0.5)
    scale = d.half().view(torch.int8)  # [..., nb, 2]: the float16's two bytes, little-endian as in memory
    return torch.cat([scale, q.to(torch.int8)], dim=-1).reshape(*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BYTES)


def dequantize_q8(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D / 32 * 34] int8 q8_0 blocks -> [..., D] values (d * q, in float32, then dtype)."""
    shape = blocks.shape
    b = blocks.reshape(*shape[:-1], shape[-1] // Q8_BYTES, Q8_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float()
    out = b[..., 2:].float() * d
    return out.reshape(*shape[:-1], -1).to(dtype)
