"""Idefics3 / SmolVLM: an image is split into square crops plus a downscaled global view; each is one tower input
whose `image_seq_len` tokens follow its marker.

    split into R x C:  <fake><row_1_col_1><image>*n <fake><row_1_col_2><image>*n \\n ... \\n
                       \\n<fake><global-img><image>*n<fake>
    not split:         <fake><global-img><image>*n<fake>

(<fake> = <fake_token_around_image>; transformers' Idefics3Processor writes the same text.) The text between
two runs is tokenised as one string, as it is inside transformers' whole prompt (the "\\n\\n" before the global
view is one token there). The folder's own Idefics3 image processor resizes and splits.
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

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


class Idefics3Processor(BaseMultimodalProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
        super().__init__(model_path, hf_config, vocab_size, tokenizer)
        self.image_token_id = self.config_token_id("image_token_id")
        vision = hf_config.get("vision_config") or {}
        size, patch, scale = vision.get("image_size"), vision.get("patch_size"), hf_config.get("scale_factor", 2)
        if not (isinstance(size, int) and isinstance(patch, int) and isinstance(scale, int) and patch > 0
                and scale > 0 and size % (patch * scale) == 0):
            raise ValueError(f"vision_config: image_size {size!r} is not a multiple of patch_size {patch!r} x "
                             f"scale_factor {scale!r}")
        self.image_size = size
        self.seq_len = (size // patch) ** 2 // scale**2
        for name in (FAKE, GLOBAL):
            if tokenizer.convert_tokens_to_ids(name) in (None, tokenizer.unk_token_id):
                raise ValueError(f"{model_path}: the tokenizer lacks {name}, which Idefics3 prompts need")
        self.image_processor = image_processor(model_path, hf_config)
        # every text that can stand between two runs, tokenised now: expand() runs on a worker thread, where the
        # tokenizer is not safe to share (its markers exist for splits up to 6 x 6)
        texts = [FAKE, f"{FAKE}{GLOBAL}", f"\n\n{FAKE}{GLOBAL}"]
        texts += [f"{nl}{FAKE}<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7) for nl in ("", "\n")]
        self.text_ids = {t: tokenizer.encode(t, add_special_tokens=False) for t in texts}

    def _ids(self, text: str) -> list[int]:
        ids = self.text_ids.get(text)
        if ids is None:
            raise ValueError(f"image_data: the image processor split an image beyond 6 x 6 crops ({text!r})")
        return ids

    def expand(self, image: Image.Image) -> list[list[int] | ImageTile]:
        out = self.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        pixels = out["pixel_values"][0].to(torch.float32)  # [crops (+ the global view), 3, H, W]
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"the image processor made {tuple(pixels.shape[-2:])} crops; the vision tower takes "
                             f"{self.image_size}x{self.image_size} (preprocessor_config.json disagrees with config.json)")
        if len(pixels) != rows * cols + 1 and not (rows == cols == 0 and len(pixels) == 1):
            raise ValueError(f"the image processor made {len(pixels)} crops for a {rows}x{cols} split")
        parts: list[list[int] | ImageTile] = []
        text = ""

        def tile(k: int) -> None:
            nonlocal text
            parts.append(self._ids(text))
            parts.append(ImageTile({"pixel_values": pixels[k : k + 1]}, self.seq_len))
            text = ""

        for r in range(rows):
            for c in range(cols):
                text += f"{FAKE}<row_{r + 1}_col_{c + 1}>"
                tile(r * cols + c)
            text += "\n"
        text += ("\n" if rows else "") + f"{FAKE}{GLOBAL}"
        tile(len(pixels) - 1)
        parts.append(self._ids(FAKE))
        return parts
