"""BaseMultimodalProcessor: a prompt's token ids + its decoded images -> input ids with image spans + items.

It runs where the prompt is tokenised (the TokenizerManager's process), so the scheduler receives plain
tensors; the vision tower runs in the scheduler's process (models/vision/). A model's processor says only
what differs: what one image becomes (`expand`: text around one or more tiles, each a tower input with its run
of image tokens). transformers' image processors do the pixel work (resize, split, normalise): they are the
oracle anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from radixserve.model_loader.hf import read_json
from radixserve.multimodal.image_loader import image_hash
from radixserve.multimodal.mm_inputs import MultimodalDataItem, MultimodalInputs, pad_value

if TYPE_CHECKING:  # a model's processor makes the tensors (and imports torch); a text model's HTTP process never does
    import torch

_MASK63 = (1 << 63) - 1


@dataclass
class PreparedImage:
    """One image, decoded and run through the image processor (the costly part: the TokenizerManager does it on a
    worker thread), waiting for its placeholder in the prompt."""

    hash: int
    parts: list[list[int] | ImageTile]


@dataclass
class ImageTile:
    """One input of the vision tower (a whole image, or one crop of a split image) and its run of tokens."""

    features: dict[str, torch.Tensor]
    length: int


class BaseMultimodalProcessor:
    """Subclasses set `image_token_id` and implement `expand`."""

    image_token_id: int

    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
        self.model_path = model_path
        self.hf_config = hf_config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer

    def config_token_id(self, *keys: str) -> int:
        """A special token's id from the config (the first of `keys` present), checked against the vocabulary:
        a lying config is refused here, not met as an index error in the embedding."""
        key = next((k for k in keys if k in self.hf_config), keys[0])
        token = self.hf_config.get(key)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
            raise ValueError(f"config {key} {token!r} is not a token of the vocabulary [0, {self.vocab_size})")
        return token

    def expand(self, image: Image.Image) -> list[list[int] | ImageTile]:
        """What one image placeholder becomes: token ids and tiles, in prompt order. It may run on a worker thread,
        so it must not call the tokenizer (a subclass tokenises its fixed texts when it is built)."""
        raise NotImplementedError

    def expand_text(self, text: str, images: list[PreparedImage]) -> str:
        """A text prompt with its images, before it is tokenised: a model whose processor writes each image's runs
        of tokens into the text (Gemma 3: "\n\n" around each, which merges with the text beside it) does it here."""
        return text

    def prepare(self, image: Image.Image) -> PreparedImage:
        return PreparedImage(image_hash(image), self.expand(image))

    def process(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], MultimodalInputs]:
        """Expand each image placeholder of `ids` (one `image_token_id` per image, in order). Each tile becomes an
        item whose span holds its pad value. Raises ValueError when the placeholders and the images do not pair."""
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(f"image_data: the prompt has {len(where)} image placeholder(s) for {len(images)} "
                             "image(s); put one image part (or the model's image token) per image")
        out: list[int] = []
        items: list[MultimodalDataItem] = []
        prev = 0
        for pos, image in zip(where, images):
            out.extend(ids[prev:pos])
            h = image.hash
            tiles = 0
            for part in image.parts:
                if isinstance(part, list):
                    out.extend(part)
                    continue
                # a crop of an image is its own tower input: its hash says which image and which crop
                th = tile_hash(h, tiles)
                pad = pad_value(self.vocab_size, th)
                items.append(MultimodalDataItem("image", th, pad, len(out), part.length, part.features))
                out.extend([pad] * part.length)
                tiles += 1
            prev = pos + 1
        out.extend(ids[prev:])
        return out, MultimodalInputs(items, self.image_token_id)


def tile_hash(image_hash: int, k: int) -> int:
    """The hash of tile k of an image (a crop is its own tower input): the image's own for the first."""
    return image_hash if k == 0 else (image_hash ^ (k * 0x9E3779B97F4A7C15)) & _MASK63


def image_processor(model_path: str, hf_config: dict[str, Any]) -> Any:
    """The model's transformers image processor, with the PIL backend, which needs no torchvision: from the
    folder's preprocessor_config.json, or from the settings an --mmproj file's metadata gave ("preprocessor")."""
    import transformers  # lazy: transformers' import is seconds; only a vision model's server pays it

    cfg = hf_config.get("preprocessor")
    if cfg is None:
        if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
            raise ValueError(f"{model_path} has no preprocessor_config.json: a vision-language model needs its image "
                             "processor's settings (size, crop, mean, std)")
        cfg = read_json(os.path.join(model_path, "preprocessor_config.json"))
    name = str(cfg.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, name + "Pil", None) or getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"{model_path}: image processor {name!r} is not in this transformers")
    if "preprocessor" in hf_config:
        return cls(**{k: v for k, v in cfg.items() if k != "image_processor_type"})
    return cls.from_pretrained(model_path)
