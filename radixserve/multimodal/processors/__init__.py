"""Per-model image processors, by the checkpoint's architecture name (lazy, like models/registry.py)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from radixserve.model_loader import get_model_config
from radixserve.model_loader.hf import read_json
from radixserve.model_loader.mmproj import with_mmproj
from radixserve.multimodal.processors.base_processor import BaseMultimodalProcessor

MM_PROCESSORS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("radixserve.multimodal.processors.llava", "LlavaProcessor"),
    "Idefics3ForConditionalGeneration": ("radixserve.multimodal.processors.idefics3", "Idefics3Processor"),
    "SmolVLMForConditionalGeneration": ("radixserve.multimodal.processors.idefics3", "Idefics3Processor"),
    "Gemma3ForConditionalGeneration": ("radixserve.multimodal.processors.gemma3", "Gemma3Processor"),
    "Qwen2_5_VLForConditionalGeneration": ("radixserve.multimodal.processors.qwen2_5_vl", "Qwen25VLProcessor"),
}


def get_mm_processor(model_path: str | None, vocab_size: int, tokenizer: Any,
                     mmproj: str | None = None) -> BaseMultimodalProcessor | None:
    """The processor of a vision-language model (an HF folder, or a text GGUF with its --mmproj file); None for a
    text-only model (its image inputs are 400s)."""
    if mmproj is not None and model_path:
        cfg = with_mmproj(get_model_config(model_path), mmproj, tokenizer).mm_config
    elif not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        return None  # a GGUF file without an mmproj: text only
    else:
        cfg = read_json(os.path.join(model_path, "config.json"))
    archs = cfg.get("architectures") or []
    entry = MM_PROCESSORS.get(archs[0]) if archs else None
    if entry is None:
        return None
    module, name = entry
    return getattr(importlib.import_module(module), name)(model_path, cfg, vocab_size, tokenizer)
