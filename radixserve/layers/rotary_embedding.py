"""Rotary position embedding (rotate-half / NeoX layout, as in Hugging Face Llama).

cos/sin are precomputed for every position once, so a step only gathers rows by `positions`
(which is what lets EXTEND and DECODE rotate tokens at arbitrary offsets with one indexing op).
Supported scalings: none/default, linear, llama3, yarn, longrope; partial rotary (rotary_dim < head_dim).
"""

from __future__ import annotations

import math

import torch

from radixserve.layers.cpu_kernel_layer import CpuKernelLayer


def _inv_freq(dim: int, base: float, scaling: dict | None, max_position: int, trained: int
              ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the `dim` rotated dims, the factor cos/sin are multiplied by), as
    transformers' rope initialisers compute them for each scaling type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
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
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, base, scaling, trained)
    if kind == "longrope":
        return _longrope(dim, base, scaling, max_position, trained)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def _yarn(dim: int, base: float, scaling: dict, trained: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's long-context scaling): frequencies below the correction band are interpolated by
    `factor`, those above kept, a linear ramp between; cos/sin scaled by the attention factor."""
    original = float(scaling.get("original_max_position_embeddings") or trained)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else trained / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point band: avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(dim: int, base: float, scaling: dict, max_position: int, trained: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, `long_factor` when the served context exceeds the original
    one, else `short_factor`. The choice is static, by the served context length (as llama.cpp makes it):
    transformers switches per forward call on the longest position, so a request's cached keys would be
    rotated with other frequencies than its later tokens."""
    original = int(scaling.get("original_max_position_embeddings") or trained)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else trained / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if max_position > original else "short_factor"
    ext = torch.tensor(scaling[key], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope {key} has {ext.numel()} entries, expected rotary dims / 2 = {dim // 2}")
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention)


class RotaryEmbedding(CpuKernelLayer):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None,
                 rotary_dim: int = 0, trained_max_position: int = 0,
                 mrope_section: tuple[int, ...] | None = None) -> None:
        """`rotary_dim`: the leading dims of each head that rotate (0: all of them; Phi-3-style partial
        rotary leaves the rest as they are). `trained_max_position`: the model's trained context (YaRN and
        LongRoPE defaults; 0: max_position). `mrope_section`: M-RoPE (Qwen2.5-VL): the rotary pairs that take
        a token's temporal, height and width positions, when positions come as [3, n] (rotate_heads)."""
        super().__init__()
        if mrope_section is not None and sum(mrope_section) != (rotary_dim or head_dim) // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} does not add up to the {(rotary_dim or head_dim) // 2} "
                             "rotary pairs of a head")
        self.mrope_section = mrope_section
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention = _inv_freq(self.rotary_dim, base, scaling, max_position,
                                        trained_max_position or max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        # YaRN / LongRoPE scale cos and sin themselves, so every kernel that reads the caches agrees
        self.register_buffer("cos_cache", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention, persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                step_rows: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, [n, 1, head_dim / 2]. One model shares this module across its
        layers, and every layer of a step passes the same positions tensor, so with the step's own cache
        (`ForwardBatch.rope_rows`) the gather is done once per step rather than once per layer."""
        # Keyed by ids, with the positions tensor kept in the value: while the step's dict lives, that tensor
        # cannot be freed, so its id cannot be reused by another positions tensor of the same step.
        key = (id(self), id(positions))
        hit = step_rows.get(key) if step_rows is not None else None
        if hit is not None:
            return hit[1], hit[2]
        cos, sin = self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
        if step_rows is not None:
            step_rows[key] = (positions, cos, sin)
        return cos, sin

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor, step_rows: dict | None = None) -> torch.Tensor:
        """Rotate every head of x [n, heads, head_dim] (q and k heads side by side: one pass, not two).
        With the C++ kernels x is rotated in place (it is a view into the step's qkv output). `step_rows`:
        the step's cos / sin cache (cos_sin)."""
        ops = self.cpu_ops
        if positions.dim() == 2:  # M-RoPE: [3, n] (t, h, w) positions, each section of pairs from its own row
            cos, sin = self.mrope_cos_sin(positions, step_rows)
            if ops is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]:
                rows = torch.arange(x.shape[0], device=x.device)  # the kernel reads row i of the per-token tables
                ops.rope_(x, rows, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous())
                return x
            return _rotate(x, cos, sin)
        if self.rotary_dim != self.head_dim:
            cos, sin = self.cos_sin(positions, step_rows)
            rot = self.rotary_dim
            return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        if (ops is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]
                and positions.is_contiguous()):
            ops.rope_(x, positions, self.cos_cache, self.sin_cache)
            return x
        cos, sin = self.cos_sin(positions, step_rows)
        return _rotate(x, cos, sin)


    def mrope_cos_sin(self, positions: torch.Tensor,
                      step_rows: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, 1, head_dim / 2] cos / sin of [3, n] positions: pairs of section k from row k (transformers'
        Qwen2.5-VL recomposition), cached per step as cos_sin's rows are."""
        if self.mrope_section is None:
            raise ValueError("[3, n] positions need a model with M-RoPE (mrope_section)")
        key = (id(self), id(positions))
        hit = step_rows.get(key) if step_rows is not None else None
        if hit is not None:
            return hit[1], hit[2]
        cos = torch.empty(positions.shape[1], self.cos_cache.shape[1], dtype=self.cos_cache.dtype,
                          device=positions.device)
        sin = torch.empty_like(cos)
        a = 0
        for k, width in enumerate(self.mrope_section):
            cos[:, a : a + width] = self.cos_cache[positions[k], a : a + width]
            sin[:, a : a + width] = self.sin_cache[positions[k], a : a + width]
            a += width
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if step_rows is not None:
            step_rows[key] = (positions, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
