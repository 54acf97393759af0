"""Model classes by Hugging Face architecture name. Entries are lazy (module, class): a model's file is
imported only when it is served. The architectures' arithmetic is declared in model_config.ARCH_SPECS; the
two tables list the same names (checked by tests/models/test_registry.py)."""

from __future__ import annotations

import importlib

from torch import nn

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("radixserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("radixserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("radixserve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("radixserve.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("radixserve.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("radixserve.models.gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("radixserve.models.phi3", "Phi3ForCausalLM"),
    # mixture of experts
    "Qwen3MoeForCausalLM": ("radixserve.models.moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("radixserve.models.moe", "Qwen2MoeForCausalLM"),
    "OlmoeForCausalLM": ("radixserve.models.moe", "OlmoeForCausalLM"),
    "MixtralForCausalLM": ("radixserve.models.moe", "MixtralForCausalLM"),
    # vision-language (model_config.VISION_ARCHITECTURES): a tower and projector beside a text decoder above
    "LlavaForConditionalGeneration": ("radixserve.models.vision.llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("radixserve.models.vision.idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("radixserve.models.vision.idefics3", "SmolVLMForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("radixserve.models.vision.gemma3", "Gemma3ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("radixserve.models.vision.qwen2_5_vl",
                                           "Qwen2_5_VLForConditionalGeneration"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        module, name = MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unknown model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
    return getattr(importlib.import_module(module), name)
