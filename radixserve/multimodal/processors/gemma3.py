"""Gemma 3: each <start_of_image> of the prompt becomes, as transformers' Gemma3Processor writes it,

    \\n\\n<start_of_image><image_soft_token> x mm_tokens_per_image<end_of_image>\\n\\n

written into the *text* before it is tokenised (expand_text): "\\n\\n" merges with the newlines beside it into one
token of Gemma's vocabulary, so expanding ids would give other ids than transformers. The run of soft tokens is
the image's span (one tower input: the 896 x 896 image the folder's Gemma3ImageProcessor makes). With pan-and-scan
(`do_pan_and_scan` in preprocessor_config.json) a wide or tall image also yields crops, each its own tower input and
run, and the placeholder becomes transformers' "Here is the original image RUN and here are some crops to help you
see better RUN RUN". A prompt given as ids (input_ids) with a lone <start_of_image> gets the run, with "\\n\\n" as
its own tokens (an image with crops needs a text prompt: their introduction is text).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from radixserve.multimodal.mm_inputs import MultimodalDataItem, MultimodalInputs, pad_value
from radixserve.multimodal.processors.base_processor import (
    BaseMultimodalProcessor,
    ImageTile,
    PreparedImage,
    image_processor,
    tile_hash,
)


class Gemma3Processor(BaseMultimodalProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
        super().__init__(model_path, hf_config, vocab_size, tokenizer)
        self.boi = self.config_token_id("boi_token_index")
        self.eoi = self.config_token_id("eoi_token_index")
        self.image_token_id = self.config_token_id("image_token_index")  # what the spans stand for
        n = hf_config.get("mm_tokens_per_image", 256)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"config mm_tokens_per_image {n!r} is not a positive integer")
        self.seq_len = n
        vision = hf_config.get("vision_config") or {}
        self.image_size = vision.get("image_size", 224)
        names = [tokenizer.convert_ids_to_tokens(t) for t in (self.boi, self.image_token_id, self.eoi)]
        if any(not isinstance(x, str) for x in names):
            raise ValueError(f"{model_path}: the tokenizer has no text for the image tokens {names}")
        self.boi_text, image_text, eoi_text = names
        self.full_sequence = f"\n\n{self.boi_text}{image_text * n}{eoi_text}\n\n"
        self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)  # for id prompts (see the docstring)
        self.image_processor = image_processor(model_path, hf_config)

    def _runs(self, image: PreparedImage) -> str:
        """transformers' Gemma3Processor.replace_image_token: the original image's run, then its crops'."""
        crops = sum(isinstance(p, ImageTile) for p in image.parts) - 1
        if crops == 0:
            return self.full_sequence
        return (f"Here is the original image {self.full_sequence} and here are some crops to help you see better "
                + " ".join([self.full_sequence] * crops))

    def expand_text(self, text: str, images: list[PreparedImage]) -> str:
        pieces = text.split(self.boi_text)
        out = [pieces[0]]
        for k, piece in enumerate(pieces[1:]):  # a marker past the images stays (process() names the mismatch)
            out.append((self._runs(images[k]) if k < len(images) else self.boi_text) + piece)
        return "".join(out)

    def expand(self, image: Image.Image) -> list[list[int] | ImageTile]:
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].to(torch.float32)  # [1 + crops, 3, H, W]: the original first
        if tuple(pixels.shape[1:]) != (3, self.image_size, self.image_size):
            raise ValueError(f"the image processor made pixels of shape {tuple(pixels.shape)}; the vision tower takes "
                             f"3 x {self.image_size} x {self.image_size} (preprocessor_config.json disagrees with "
                             "config.json)")
        return [ImageTile({"pixel_values": pixels[k : k + 1]}, self.seq_len) for k in range(len(pixels))]

    def process(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], MultimodalInputs]:
        """Each <start_of_image> of `ids`, one per run (an image and each of its crops): an expanded run (a text
        prompt) gets the tile's pad value in its soft tokens; a lone marker (an id prompt) gets the whole sequence
        around it."""
        where = [i for i, t in enumerate(ids) if t == self.boi]
        tiles = [(image, k, tile) for image in images
                 for k, tile in enumerate(p for p in image.parts if isinstance(p, ImageTile))]
        if len(where) == len(images) < len(tiles):  # one lone marker an image, some cut into crops
            raise ValueError("image_data: an image cut into pan-and-scan crops needs a text prompt (transformers "
                             "introduces its crops in text); send text, not input_ids")
        if len(where) != len(tiles):
            raise ValueError(f"image_data: the prompt has {len(where)} image run(s) for {len(images)} image(s) "
                             f"({len(tiles)} with their crops); put one image part (or {self.boi_text}) per image")
        n = self.seq_len
        out: list[int] = []
        items: list[MultimodalDataItem] = []
        prev = 0
        for pos, (image, k, tile) in zip(where, tiles):
            expanded = ids[pos + 1 : pos + 1 + n] == [self.image_token_id] * n and ids[pos + 1 + n : pos + 2 + n] == [
                self.eoi]
            if not expanded and len(image.parts) > 1:
                raise ValueError("image_data: an image cut into pan-and-scan crops needs a text prompt (transformers "
                                 "introduces its crops in text); send text, not input_ids")
            out.extend(ids[prev:pos])
            if not expanded:
                out.extend(self.newlines)
            out.append(self.boi)
            th = tile_hash(image.hash, k)
            pad = pad_value(self.vocab_size, th)
            items.append(MultimodalDataItem("image", th, pad, len(out), n, tile.features))
            out.extend([pad] * n)
            out.append(self.eoi)
            if expanded:
                prev = pos + 2 + n
            else:
                out.extend(self.newlines)
                prev = pos + 1
        out.extend(ids[prev:])
        return out, MultimodalInputs(items, self.image_token_id)
