"""Gemma 2 and Gemma 3 (text): four norms a block (around attention and around the MLP), norms that
multiply by (1 + w), embeddings scaled by sqrt(hidden), a GELU-tanh gated MLP, q.k scaled by
query_pre_attn_scalar ** -0.5, alternating sliding-window layers.
    Gemma 2  attention and final-logit soft-caps; every other layer slides
    Gemma 3  QK-norm; five sliding layers (RoPE base 10k) to one global (1M)
All of it is ModelConfig data (model_config.ARCH_SPECS) read by the shared pieces of models/base.py."""

from __future__ import annotations

from radixserve.models.base import CausalLM


class Gemma2ForCausalLM(CausalLM):
    pass


class Gemma3ForCausalLM(CausalLM):
    pass
