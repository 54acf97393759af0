"""Phi-3 / Phi-4-mini: the Llama block with q/k/v and gate/up stored fused in the checkpoint, optional
partial rotary (Phi-4-mini rotates 3/4 of each head), LongRoPE on the 128k variants, and a sliding window
on some (Phi-3-mini-4k: 2047)."""

from __future__ import annotations

from radixserve.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    fused_checkpoint_params = (".qkv_proj.", ".gate_up_proj.")
