"""LLaVA-1.5: one run of patch tokens per image, in place of the prompt's `<image>` token.

The run has (image_size / patch_size)^2 tokens, plus the CLS token when `vision_feature_select_strategy` is
"full" (transformers' LlavaProcessor counts the same). The pixels go through the folder's own CLIP image
processor (preprocessor_config.json: resize, centre crop, normalise).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from PIL import Image

from radixserve.model_loader.hf import read_json
from radixserve.multimodal.processors.base_processor import BaseMultimodalProcessor


class LlavaProcessor(BaseMultimodalProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int) -> None:
        super().__init__(model_path, hf_config, vocab_size)
        token = hf_config.get("image_token_index", hf_config.get("image_token_id"))
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"config image_token_index {token!r} is not a token of the vocabulary [0, {vocab_size})")
        self.image_token_id = token
        vision = hf_config.get("vision_config") or {}
        size, patch = vision.get("image_size"), vision.get("patch_size")
        if not (isinstance(size, int) and isinstance(patch, int) and patch > 0 and size % patch == 0):
            raise ValueError(f"vision_config: image_size {size!r} is not a multiple of patch_size {patch!r}")
        self.image_size = size
        full = hf_config.get("vision_feature_select_strategy", "default") == "full"
        self.num_tokens = (size // patch) ** 2 + (1 if full else 0)
        self.image_processor = _image_processor(model_path)

    def image_features(self, image: Image.Image) -> dict[str, torch.Tensor]:
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"the image processor made {tuple(pixels.shape[-2:])} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size} (preprocessor_config.json disagrees with config.json)")
        return {"pixel_values": pixels.to(torch.float32)}

    def tokens_per_image(self, features: dict[str, torch.Tensor]) -> int:
        return self.num_tokens


def _image_processor(model_path: str) -> Any:
    """The folder's image processor; the PIL backend, which needs no torchvision."""
    if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        raise ValueError(f"{model_path} has no preprocessor_config.json: a vision-language model needs its image "
                         "processor's settings (size, crop, mean, std)")
    import transformers  # lazy: transformers' import is seconds; only a vision model's server pays it

    cfg = read_json(os.path.join(model_path, "preprocessor_config.json"))
    name = str(cfg.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, name + "Pil", None) or getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"{model_path}: image processor {name!r} is not in this transformers")
    return cls.from_pretrained(model_path)
