"""Vision-language configs: the text decoder's config sits under `text_config` (built as that model's own
ModelConfig, which then carries the whole config as `mm_config`), the vision tower's under `vision_config`
(read by models/vision/). Each architecture here also needs its processor in multimodal/processors/."""

from __future__ import annotations

from typing import Any

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                        "SmolVLMForConditionalGeneration", "Gemma3ForConditionalGeneration",
                        "Qwen2_5_VLForConditionalGeneration")


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
    for key in ("rope_parameters", "rope_scaling"):  # M-RoPE's sections are read by mrope_section(): plain RoPE here
        rope = out.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope = {k: v for k, v in rope.items() if k != "mrope_section"}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
            out[key] = rope
    return out


def mrope_section(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """Qwen2.5-VL's M-RoPE: how many rotary pairs of a head take the (temporal, height, width) positions, from its
    text config's rope parameters (transformers' default [16, 24, 24] where the config names none); None for the
    other models. A llama.cpp qwen2vl text file's config carries it at the top (gguf_arch.py)."""
    if (cfg.get("architectures") or [None])[0] != "Qwen2_5_VLForConditionalGeneration" and "mrope_section" not in cfg:
        return None
    text = cfg.get("text_config") or {}
    for rope in (cfg, text.get("rope_parameters"), text.get("rope_scaling"), cfg.get("rope_scaling")):
        if isinstance(rope, dict) and "mrope_section" in rope:
            section = rope["mrope_section"]
            if not (isinstance(section, list) and len(section) == 3 and all(isinstance(x, int) and x >= 0
                                                                          for x in section)):
                raise ValueError(f"config mrope_section {section!r} is not three non-negative integers")
            return tuple(section)
    return (16, 24, 24)
