"""LLaVA-1.5: a CLIP vision tower, a 2-layer MLP projector, and a text decoder (models/vision/vision_language.py).

Checkpoint names come in three layouts, all mapped here:
    language_model.model.* / language_model.lm_head.*    (transformers 4 saves, llava-hf)
    model.language_model.* / lm_head.*                   (transformers 5 in memory)
    vision_tower.vision_model.* / vision_tower.* / model.vision_tower.*, multi_modal_projector.* (+ model.)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.vision.clip import CLIPVisionTower
from radixserve.models.vision.llava_projector import (
    SELECT_STRATEGIES,
    LlavaMultiModalProjector,
    llava_image_features,
)
from radixserve.models.vision.vision_language import VisionBuilders, VisionLanguageModel
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class LlavaForConditionalGeneration(VisionLanguageModel):
    vision_modules: ClassVar[VisionBuilders] = {
        "vision_tower": lambda mm: CLIPVisionTower(mm["vision_config"]),
        "multi_modal_projector": LlavaMultiModalProjector.from_config,
    }
    checkpoint_renames = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                          ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                          ("model.multi_modal_projector.", "multi_modal_projector."))

    def __init__(self, cfg: ModelConfig, ps: Any) -> None:
        super().__init__(cfg, ps)
        mm = cfg.mm_config or {}
        self.feature_layer = mm.get("vision_feature_layer", -2)
        self.select_strategy = mm.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"model config vision_feature_select_strategy {self.select_strategy!r} is not one of "
                             f"{SELECT_STRATEGIES}")

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        pixels = item.features["pixel_values"].to(self.vision_dtype)
        return llava_image_features(self.vision_tower, self.multi_modal_projector, pixels, self.feature_layer,
                                    self.select_strategy)[0]
