"""The 8-bit KV cache (--kv-cache-dtype int8): llama.cpp's q8_0 blocks, as the C++ kernels read them in place.

A layer's K (or V) buffer is int8 [slots, kv_heads, head_dim / 32 * 34]: each row of head_dim values is blocks of
34 bytes, a float16 scale d then 32 int8 values q (value = d * q; 8.5 bits a value, ggml's block_q8_0). The
kernels (kernels/cpu/csrc/kv_quant.h) address it as [slots, kv_heads, head_dim] values; the PyTorch writer here
computes the same bits as their store_row_q8 (ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(x / d) half
away from zero, d rounded to float16 to nearest even), so a K/V row is identical whichever path wrote it.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32
Q8_BYTES = 34  # a float16 scale + 32 int8 values

# The quantised KV dtypes a pool stores: "int8", q8_0 blocks in an int8 tensor; "fp8_e4m3", rows of a float32
# scale and head_dim e4m3 values in a float8_e4m3fn tensor
KV_INT8 = torch.int8
KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one (slot, kv head) row of head_dim values."""
    if head_dim % Q8_BLOCK:
        raise ValueError(f"kv_cache_dtype int8 needs a head_dim that is a multiple of {Q8_BLOCK}, got {head_dim}")
    return head_dim // Q8_BLOCK * Q8_BYTES


def kv_row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of a pool tensor's (slot, kv head) row: head_dim, or a quantised dtype's bytes (one rule for the pool,
    the memory budget and the disk tier)."""
    if dtype == KV_INT8:
        return q8_row_bytes(head_dim)
    if dtype == KV_FP8:
        if head_dim < 8 or head_dim & (head_dim - 1):
            raise ValueError(f"kv_cache_dtype fp8_e4m3 needs a head_dim that is a power of two >= 8, got {head_dim}")
        return head_dim + 4
    return head_dim


def kv_bytes_per_value(dtype: torch.dtype, head_dim: int = 64) -> float:
    """Bytes one K or V value takes in a pool of this dtype (q8_0: 34 bytes per 32 values; fp8: a byte, plus a
    4-byte scale per row of head_dim)."""
    if dtype == KV_INT8:
        return Q8_BYTES / Q8_BLOCK
    if dtype == KV_FP8:
        return (head_dim + 4) / head_dim
    return torch.finfo(dtype).bits / 8


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


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] float8_e4m3fn rows: a float32 scale (amax / 448, as 4 raw bytes) then x / scale
    in e4m3 (round to nearest even: the C++ writer's c10 conversion)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    q = torch.where(s > 0, xf / s, torch.zeros_like(xf)).to(KV_FP8)
    return torch.cat([s.contiguous().view(KV_FP8), q], dim=-1)


def dequantize_fp8(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] float8_e4m3fn rows -> [..., D] values (e4m3 * scale, in float32, then dtype)."""
    s = rows[..., :4].contiguous().view(torch.float32)
    return (rows[..., 4:].float() * s).to(dtype)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] as a pool of `dtype` stores them."""
    if dtype == KV_INT8:
        return quantize_q8(x)
    return quantize_fp8(x) if dtype == KV_FP8 else x.to(dtype)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows of any KV dtype -> [..., D] values in `dtype`."""
    if rows.dtype == KV_INT8:
        return dequantize_q8(rows, dtype)
    return dequantize_fp8(rows, dtype) if rows.dtype == KV_FP8 else rows.to(dtype)


def dequantize_q8(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D / 32 * 34] int8 q8_0 blocks -> [..., D] values (d * q, in float32, then dtype)."""
    shape = blocks.shape
    b = blocks.reshape(*shape[:-1], shape[-1] // Q8_BYTES, Q8_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float()
    out = b[..., 2:].float() * d
    return out.reshape(*shape[:-1], -1).to(dtype)
