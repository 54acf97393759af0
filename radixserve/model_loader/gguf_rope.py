"""RoPE scaling from GGUF metadata, in the HF `rope_scaling` dict form.

llama.cpp stores linear/YaRN scaling as `{arch}.rope.scaling.*` keys, but Llama-3 style scaling only as
a `rope_freqs.weight` tensor of per-frequency divisors. We recover HF's llama3 parameters from that
tensor so the model is served with the frequencies it was trained with.
"""

from __future__ import annotations

import math

import numpy as np

from radixserve.model_loader.gguf_file import GGUFFile

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Phi-3's LongRoPE: convert_hf_to_gguf writes the per-frequency factors as two tensors
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# llama.cpp yarn metadata suffix -> HF yarn key.
_YARN_KEYS = {
    "rope.scaling.attn_factor": "attention_factor",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
}


def gguf_rope_scaling(f: GGUFFile, rope_theta: float, head_dim: int) -> dict | None:
    """The HF-style rope_scaling dict for a GGUF file, or None for plain RoPE."""
    arch = f.architecture
    kind = str(f.get(f"{arch}.rope.scaling.type", "")).lower()
    factor = f.get(f"{arch}.rope.scaling.factor", None)
    if not kind and f.has(f"{arch}.rope.scale_linear"):
        # Pre-2024 files spelled linear scaling as a single key.
        kind, factor = "linear", f.get(f"{arch}.rope.scale_linear")
    if kind in ("linear", "yarn"):
        if factor is None:
            raise ValueError(f"GGUF file {f.path}: {kind} rope scaling without {arch}.rope.scaling.factor")
        scaling: dict = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = int(
                f.get(f"{arch}.rope.scaling.original_context_length", f.get(f"{arch}.context_length"))
            )
            for suffix, hf_key in _YARN_KEYS.items():
                if f.has(f"{arch}.{suffix}"):
                    scaling[hf_key] = float(f.get(f"{arch}.{suffix}"))
        return scaling
    if kind not in ("", "none"):
        raise ValueError(f"GGUF file {f.path}: unsupported rope scaling type {kind!r}")
    if LONGROPE_TENSORS[0] in f.tensors or LONGROPE_TENSORS[1] in f.tensors:
        return _longrope(f, arch)
    if ROPE_FREQS_TENSOR in f.tensors:
        factors = f.dequantize(ROPE_FREQS_TENSOR).reshape(-1).astype(np.float64)
        return llama3_scaling_from_factors(factors, rope_theta, head_dim)
    return None


def _longrope(f: GGUFFile, arch: str) -> dict:
    """HF's longrope parameters from the factor tensors and llama.cpp's scaling keys."""
    missing = [t for t in LONGROPE_TENSORS if t not in f.tensors]
    if missing:
        raise ValueError(f"GGUF file {f.path}: LongRoPE needs both {LONGROPE_TENSORS}, lacks {missing[0]!r}")
    key = f"{arch}.rope.scaling.original_context_length"
    if not f.has(key):
        raise ValueError(f"GGUF file {f.path}: LongRoPE factors without {key}")
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(f.get(key)),
               "long_factor": f.dequantize(LONGROPE_TENSORS[0]).reshape(-1).tolist(),
               "short_factor": f.dequantize(LONGROPE_TENSORS[1]).reshape(-1).tolist()}
    if f.has(f"{arch}.rope.scaling.attn_factor"):
        scaling["attention_factor"] = float(f.get(f"{arch}.rope.scaling.attn_factor"))
    return scaling


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low: float, high: float, original_ctx: float
) -> np.ndarray:
    """The per-frequency divisors llama.cpp precomputes for HF's "llama3" rope type."""
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth == 1 -> divisor 1 (high frequencies kept), smooth == 0 -> divisor `factor`.
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """Recover HF llama3 rope parameters from llama.cpp's `rope_freqs` divisors.

    Only the two wavelength thresholds original_ctx/low and original_ctx/high matter to the
    frequencies, so we fix low_freq_factor = 1 and fit the rest from the frequencies in the smooth
    band, where 1/divisor is linear in 1/wavelength. The fit is checked by recomputing every divisor;
    a tensor that llama3 scaling cannot explain raises ValueError.
    """
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has {factors.shape[0]} entries, expected head_dim/2 = {head_dim // 2}")
    factor = float(factors.max())
    if abs(factor - 1.0) < 1e-6:
        return None
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv_wavelen = inv_freq / (2 * math.pi)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if band.sum() >= 2:
        # smooth = (original_ctx * inv_wavelen - low) / (high - low) = slope * inv_wavelen + icpt
        slope, icpt = np.polyfit(inv_wavelen[band], smooth[band], 1)
        if slope <= 0 or icpt >= 0:
            raise ValueError("rope_freqs tensor does not look like llama3 rope scaling")
        low, high, original_ctx = 1.0, 1.0 - 1.0 / icpt, -slope / icpt
        scaling = {
            "rope_type": "llama3",
            "factor": round(factor, 4),
            "low_freq_factor": low,
            "high_freq_factor": round(high, 4),
            "original_max_position_embeddings": round(float(original_ctx)),
        }
    else:
        # Too few frequencies inside the band to fit it: Meta's published values, if they fit.
        scaling = {
            "rope_type": "llama3",
            "factor": round(factor, 4),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    recomputed = llama3_rope_factors(
        rope_theta,
        head_dim,
        scaling["factor"],
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    if not np.allclose(recomputed, factors, rtol=1e-3, atol=1e-3):
        raise ValueError(
            "rope_freqs tensor does not match llama3 rope scaling; cannot recover its parameters"
        )
    return scaling
