"""Llama-family decoders: Llama 2/3 (llama3 RoPE), SmolLM2, Mistral (its sliding window), Qwen2 / Qwen2.5
(q/k/v bias, YaRN). The baseline architecture: pre-norm blocks, GQA, SiLU-gated MLP, tied or untied
embeddings. Everything they differ in is ModelConfig data, so the classes only name the architecture."""

from __future__ import annotations

from radixserve.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    pass


class MistralForCausalLM(CausalLM):
    pass


class Qwen2ForCausalLM(CausalLM):
    pass
