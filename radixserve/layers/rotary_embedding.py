"""Rotary position embedding (rotate-half / NeoX layout, as in Hugging Face Llama).

cos/sin are precomputed for every position once, so a step only gathers rows by `positions`
(which is what lets EXTEND and DECODE rotate tokens at arbitrary offsets with one indexing op).
Supported scalings: none/default, linear, llama3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    cpu_ops: Any = None  # torch.ops.radixserve_cpu when the runner enabled the C++ CPU kernels

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, [n, 1, head_dim / 2]. One model shares this module across its
        layers, and every layer of a step passes the same positions tensor, so the gather is done
        once per step rather than once per layer."""
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        self._memo = (positions, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [n, num_heads, head_dim], k: [n, num_kv_heads, head_dim]
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate every head of x [n, heads, head_dim] (q and k heads side by side: one pass, not two).
        With the C++ kernels x is rotated in place (it is a view into the step's qkv output)."""
        ops = self.cpu_ops
        if (ops is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]
                and positions.is_contiguous()):
            ops.rope_(x, positions, self.cos_cache, self.sin_cache)
            return x
        cos, sin = self.cos_sin(positions)
        return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
