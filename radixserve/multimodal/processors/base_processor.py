"""BaseMultimodalProcessor: a prompt's token ids + its decoded images -> input ids with image spans + items.

It runs where the prompt is tokenised (the TokenizerManager's process), so the scheduler receives plain
tensors; the vision tower runs in the scheduler's process (models/vision/). A model's processor says only
what differs: how many tokens an image becomes, the tensors its tower reads, and the ids around a span.
transformers' image processors do the pixel work (resize, crop, normalise): they are the oracle anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from radixserve.multimodal.image_loader import image_hash
from radixserve.multimodal.mm_inputs import MultimodalDataItem, MultimodalInputs, pad_value


class BaseMultimodalProcessor:
    """Subclasses set `image_token_id` and implement `tokens_per_image` and `image_features`."""

    image_token_id: int

    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int) -> None:
        self.model_path = model_path
        self.hf_config = hf_config
        self.vocab_size = vocab_size

    def tokens_per_image(self, features: dict[str, torch.Tensor]) -> int:
        raise NotImplementedError

    def image_features(self, image: Image.Image) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def process(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int], MultimodalInputs]:
        """Expand each image placeholder of `ids` (one `image_token_id` per image, in order) into its span of
        pad values. Raises ValueError when the placeholders and the images do not pair up."""
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(f"image_data: the prompt has {len(where)} image placeholder(s) for {len(images)} "
                             "image(s); put one image part (or the model's image token) per image")
        out: list[int] = []
        items: list[MultimodalDataItem] = []
        prev = 0
        for k, (pos, image) in enumerate(zip(where, images)):
            out.extend(ids[prev:pos])
            features = self.image_features(image)
            n = self.tokens_per_image(features)
            h = image_hash(image)
            pad = pad_value(self.vocab_size, h)
            items.append(MultimodalDataItem("image", h, pad, len(out), n, features))
            out.extend([pad] * n)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, MultimodalInputs(items, self.image_token_id)
