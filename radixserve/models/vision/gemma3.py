"""Gemma 3 (4B and up): a SigLIP vision tower (896 x 896, 14-pixel patches), the average-pool projector, and the
Gemma 3 text decoder (models/vision/vision_language.py). An image is 256 soft tokens between <start_of_image> and
<end_of_image> (multimodal/processors/gemma3.py), and those tokens attend to each other both ways, as
transformers' Gemma 3 masks them: the step's ForwardBatch.attn_q_last lets each image row see to its span's end,
on sliding and global layers alike, and the scheduler computes each span in one step.

Checkpoint names: language_model.model.* / vision_tower.vision_model.* / multi_modal_projector.* (the hub's
files), or model.language_model.* / model.vision_tower.* / model.multi_modal_projector.* (transformers 5).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from radixserve.models.vision.gemma3_projector import Gemma3MultiModalProjector
from radixserve.models.vision.siglip import SiglipVisionTower
from radixserve.models.vision.vision_language import VisionBuilders, VisionLanguageModel
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    vision_modules: ClassVar[VisionBuilders] = {
        "vision_tower": lambda mm: SiglipVisionTower(mm["vision_config"]),
        "multi_modal_projector": Gemma3MultiModalProjector.from_config,
    }
    checkpoint_renames = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                          ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                          ("model.multi_modal_projector.", "multi_modal_projector."))
    image_spans_bidirectional = True

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        pixels = item.features["pixel_values"].to(self.vision_dtype)
        return self.multi_modal_projector(self.vision_tower(pixels))[0]
