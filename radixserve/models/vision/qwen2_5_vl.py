"""Qwen2.5-VL: its vision transformer (window attention, 2-D rotary, patch merger: models/vision/qwen2_5_vl_vision.py)
beside the engine's Qwen2 decoder with M-RoPE: a token's rotary position is three (temporal, height, width), the
image's tokens taking their grid's rows and columns (multimodal/processors/qwen2_5_vl.py computes them with the
prompt; ForwardBatch.mrope_positions carries a step's; RotaryEmbedding.mrope_cos_sin rotates by them).

Checkpoint names: model.layers.* / visual.* / lm_head.* (the hub's files), or model.language_model.* /
model.visual.* / lm_head.* (transformers 5).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from radixserve.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from radixserve.models.vision.qwen2_5_vl_vision import Qwen25VisionTower
from radixserve.models.vision.vision_language import VisionBuilders, VisionLanguageModel
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):  # noqa: N801 (transformers' class name)
    vision_modules: ClassVar[VisionBuilders] = {"visual": lambda mm: Qwen25VisionTower(mm["vision_config"])}
    checkpoint_renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        pixels = item.features["pixel_values"].to(self.vision_dtype)
        return self.visual(pixels, item.features["image_grid_thw"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                pp_proxy: PPProxyTensors | None = None) -> Any:
        if forward_batch.mrope_positions is not None:  # [3, n]: the step has a request with images
            positions = forward_batch.mrope_positions
        return super().forward(input_ids, positions, forward_batch, pp_proxy)
