"""GGUF metadata -> ModelConfig: shapes, token ids, head size and RoPE scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from radixserve.model_loader import get_model_config, iterate_weights
from radixserve.model_loader.gguf_rope import llama3_rope_factors, llama3_scaling_from_factors


def test_tiny_config_fields(tiny_gguf) -> None:
    m = tiny_gguf(hidden=64, heads=4, kv_heads=2, ffn=128, vocab=96, layers=3, context=512, rope_theta=5e5)
    cfg = get_model_config(str(m.path))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers) == (128, 96, 3)
    assert cfg.head_dim == 16
    assert cfg.context_len == 512
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert get_model_config(str(m.path), context_length=128).context_len == 128


def test_end_of_turn_ids_count_as_eos(tiny_gguf) -> None:
    m = tiny_gguf(metadata={"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2})
    assert get_model_config(str(m.path)).eos_token_ids == (2, 7)


def test_missing_token_ids(tiny_gguf) -> None:
    m = tiny_gguf(metadata={"tokenizer.ggml.eos_token_id": None, "tokenizer.ggml.bos_token_id": None})
    cfg = get_model_config(str(m.path))
    assert cfg.bos_token_id is None and cfg.eos_token_ids == ()


def test_head_dim_from_key_length(tiny_gguf) -> None:
    # Mistral-Nemo style: head_dim is not hidden/heads, and llama.cpp then records key_length.
    m = tiny_gguf(hidden=64, heads=2, kv_heads=1, metadata={"llama.attention.key_length": 32})
    assert get_model_config(str(m.path)).head_dim == 32


def test_missing_required_metadata_is_named(tiny_gguf) -> None:
    m = tiny_gguf(metadata={"llama.feed_forward_length": None})
    with pytest.raises(ValueError, match="missing metadata llama.feed_forward_length"):
        get_model_config(str(m.path))


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
            {"rope_type": "linear", "factor": 2.0},
        ),
        ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        ({"llama.rope.scaling.type": "none"}, None),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 32768,
            },
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
    ],
)
def test_rope_scaling_metadata(tiny_gguf, metadata: dict, expected: dict | None) -> None:
    m = tiny_gguf(metadata=metadata)
    assert get_model_config(str(m.path)).rope_scaling == expected


def test_unknown_rope_scaling_type(tiny_gguf) -> None:
    m = tiny_gguf(metadata={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        get_model_config(str(m.path))


def reference_rope_freqs(
    theta: float, dim: int, factor: float, low: float, high: float, ctx: int
) -> np.ndarray:
    """The per-frequency loop llama.cpp's converter runs for a "llama3" rope_scaling."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(("factor", "hidden"), [(8.0, 256), (32.0, 256), (8.0, 64)])
def test_llama3_rope_recovered_from_rope_freqs(tiny_gguf, factor: float, hidden: int) -> None:
    # hidden 256 / 4 heads: head_dim 64, several frequencies in the smooth band, so the band is fitted;
    # hidden 64: head_dim 16, one frequency in the band, so Meta's standard values are verified instead.
    theta = 500000.0
    freqs = reference_rope_freqs(theta, hidden // 4, factor, 1.0, 4.0, 8192)
    m = tiny_gguf(
        hidden=hidden, heads=4, kv_heads=2, rope_theta=theta, context=131072,
        extra_tensors={"rope_freqs.weight": freqs},
    )  # fmt: skip
    cfg = get_model_config(str(m.path))
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert cfg.context_len == 131072
    assert "rope_freqs.weight" not in {name for name, _ in iterate_weights(str(m.path))}


def test_llama3_fit_is_equivalent_for_other_thresholds() -> None:
    # Only original_ctx/low and original_ctx/high matter, so the fitted parameters may differ from the
    # ones written, but must reproduce the same divisors.
    theta, dim = 500000.0, 128
    freqs = reference_rope_freqs(theta, dim, 16.0, 2.0, 5.0, 16384).astype(np.float64)
    got = llama3_scaling_from_factors(freqs, theta, dim)
    assert got is not None and got["factor"] == 16.0
    args = (
        got["factor"],
        got["low_freq_factor"],
        got["high_freq_factor"],
        got["original_max_position_embeddings"],
    )
    np.testing.assert_allclose(llama3_rope_factors(theta, dim, *args), freqs, rtol=1e-3)


def test_rope_freqs_of_ones_mean_no_scaling() -> None:
    assert llama3_scaling_from_factors(np.ones(32), 10000.0, 64) is None


def test_rope_freqs_that_are_not_llama3_are_refused() -> None:
    with pytest.raises(ValueError, match="llama3"):
        llama3_scaling_from_factors(np.linspace(1.0, 3.0, 32), 10000.0, 64)
