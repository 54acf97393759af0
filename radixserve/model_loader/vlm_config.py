"""Vision-language configs: the text decoder's config sits under `text_config` (built as that model's own
ModelConfig, which then carries the whole config as `mm_config`), the vision tower's under `vision_config`
(read by models/vision/). Each architecture here also needs its processor in multimodal/processors/."""

from __future__ import annotations

from typing import Any

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                        "SmolVLMForConditionalGeneration", "Gemma3ForConditionalGeneration")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's HF config dict, with the outer config's tying of the embeddings (its stop tokens are
    merged by the caller)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not isinstance(cfg.get("vision_config"), dict):
        name = (cfg.get("architectures") or ["a vision-language model"])[0]
        raise ValueError(f"{name}: config needs text_config and vision_config objects")  # noqa: TRY004
    out = dict(text)
    # the decoder's class follows its model_type: some name a class of their own there (SmolVLM: VLlama3ForCausalLM)
    if out.get("model_type"):
        out.pop("architectures", None)
    out.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return out
