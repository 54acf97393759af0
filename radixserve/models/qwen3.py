"""Qwen3: the Llama block with per-head RMSNorm of q and k before RoPE (ModelConfig.qk_norm) and a head_dim
of its own (128 on every size, whatever hidden / heads is)."""

from __future__ import annotations

from radixserve.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    pass
