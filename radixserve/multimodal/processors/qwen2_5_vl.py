"""Qwen2.5-VL: the template's <|vision_start|><|image_pad|><|vision_end|> holds one <|image_pad|> per image, which
becomes grid_t * grid_h * grid_w / merge^2 of them (transformers' Qwen2_5_VLProcessor; the pad is a special token, so
expanding ids equals expanding text). The folder's Qwen2VLImageProcessor resizes (multiples of 28 pixels, within
its pixel bounds) and flattens the patches; the grid travels with the pixels to the tower.

The prompt's M-RoPE positions are computed here, once, as transformers' get_rope_index does: text tokens count up
on all three rows; an image's tokens take (start, start + row, start + column) of its merged grid; the text after
it starts past the grid's longer side. Later tokens add the prompt's delta (the last position + 1 - its length).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from radixserve.multimodal.mm_inputs import MultimodalInputs
from radixserve.multimodal.processors.base_processor import (
    BaseMultimodalProcessor,
    ImageTile,
    PreparedImage,
    image_processor,
)


class Qwen25VLProcessor(BaseMultimodalProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
        super().__init__(model_path, hf_config, vocab_size, tokenizer)
        self.image_token_id = self.config_token_id("image_token_id")
        vision = hf_config.get("vision_config") or {}
        self.merge = vision.get("spatial_merge_size", 2)
        if not isinstance(self.merge, int) or self.merge < 1:
            raise ValueError(f"vision_config.spatial_merge_size {self.merge!r} is not a positive integer")
        self.image_processor = image_processor(model_path, hf_config)

    def expand(self, image: Image.Image) -> list[list[int] | ImageTile]:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.int64)  # [1, 3]
        t, h, w = (int(x) for x in grid[0])
        if h % self.merge or w % self.merge:
            raise ValueError(f"the image processor made a {h} x {w} patch grid, not in whole {self.merge} x "
                             f"{self.merge} merge blocks (preprocessor_config.json disagrees with config.json)")
        return [ImageTile({"pixel_values": out["pixel_values"].to(torch.float32), "image_grid_thw": grid},
                          t * h * w // (self.merge * self.merge))]

    def process(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], MultimodalInputs]:
        out, mm = super().process(ids, images)
        rows, cur, i = [], 0, 0
        for item in mm.items:
            text = item.offset - i
            rows.append(torch.arange(cur, cur + text).expand(3, -1))
            cur += text
            t, h, w = (int(x) for x in item.features["image_grid_thw"][0])
            gh, gw = h // self.merge, w // self.merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            rows.append(grid.reshape(3, -1) + cur)
            cur += max(gh, gw)
            i = item.end
        rows.append(torch.arange(cur, cur + len(out) - i).expand(3, -1))
        table = torch.cat(rows, dim=1).contiguous()
        mm.mrope_positions, mm.mrope_delta = table, int(table.max()) + 1 - len(out)
        return out, mm
