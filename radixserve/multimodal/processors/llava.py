"""LLaVA-1.5: one run of patch tokens per image, in place of the prompt's `<image>` token.

The run has (image_size / patch_size)^2 tokens, plus the CLS token when `vision_feature_select_strategy` is
"full" (transformers' LlavaProcessor counts the same). The pixels go through the folder's own CLIP image
processor (preprocessor_config.json: resize, centre crop, normalise).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from radixserve.multimodal.processors.base_processor import (
    BaseMultimodalProcessor,
    ImageTile,
    image_processor,
)


class LlavaProcessor(BaseMultimodalProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
        super().__init__(model_path, hf_config, vocab_size, tokenizer)
        self.image_token_id = self.config_token_id("image_token_index", "image_token_id")
        vision = hf_config.get("vision_config") or {}
        size, patch = vision.get("image_size"), vision.get("patch_size")
        if not (isinstance(size, int) and isinstance(patch, int) and patch > 0 and size % patch == 0):
            raise ValueError(f"vision_config: image_size {size!r} is not a multiple of patch_size {patch!r}")
        self.image_size = size
        full = hf_config.get("vision_feature_select_strategy", "default") == "full"
        self.num_tokens = (size // patch) ** 2 + (1 if full else 0)
        self.image_processor = image_processor(model_path, hf_config)

    def expand(self, image: Image.Image) -> list[list[int] | ImageTile]:
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"the image processor made {tuple(pixels.shape[-2:])} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size} (preprocessor_config.json disagrees with config.json)")
        return [ImageTile({"pixel_values": pixels.to(torch.float32)}, self.num_tokens)]
