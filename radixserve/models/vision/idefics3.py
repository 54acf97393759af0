"""Idefics3 / SmolVLM / SmolVLM2: a SigLIP vision tower, the pixel-shuffle connector, and a Llama text decoder
(models/vision/vision_language.py). Each crop of a split image is one tower input (multimodal/processors/idefics3.py).

Checkpoint names: model.vision_model.*, model.connector.*, model.text_model.*, lm_head.* (transformers 4 and 5).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from radixserve.models.vision.idefics3_connector import Idefics3Connector, idefics3_image_features
from radixserve.models.vision.siglip import SiglipVisionTower
from radixserve.models.vision.vision_language import VisionBuilders, VisionLanguageModel
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    vision_modules: ClassVar[VisionBuilders] = {
        "vision_model": lambda mm: SiglipVisionTower(mm["vision_config"]),
        "connector": Idefics3Connector.from_config,
    }
    checkpoint_renames = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
                          ("model.connector.", "connector."))

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        pixels = item.features["pixel_values"].to(self.vision_dtype)
        return idefics3_image_features(self.vision_model, self.connector, pixels)[0]


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM2: Idefics3's tower, connector, names and image prompts (transformers' SmolVLM modules are copies)."""
