"""Idefics3 / SmolVLM connector: pixel shuffle (space-to-depth over the patch grid) then a bias-free linear
projection, and the vision-tower -> connector path that turns pixels into the embeddings of the image tokens."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from radixserve.models.vision.clip import config_field, load_module_weights
from radixserve.models.vision.siglip import SiglipVisionTower


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, output_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden_size: int, text_hidden_size: int, scale_factor: int = 2) -> None:
        super().__init__()
        if scale_factor < 1:
            raise ValueError(f"unsupported scale_factor={scale_factor}")
        self.scale_factor = scale_factor
        self.vision_hidden_size = vision_hidden_size
        self.modality_projection = Idefics3SimpleMLP(vision_hidden_size * scale_factor**2, text_hidden_size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> Idefics3Connector:
        """From a transformers Idefics3Config / SmolVLMConfig or its config.json dict (defaults as Idefics3Config's:
        vision hidden 1152, Llama text hidden 4096, scale_factor 2)."""
        vision = config_field(config, "vision_config") or {}
        text = config_field(config, "text_config") or {}
        return cls(
            vision_hidden_size=config_field(vision, "hidden_size", 1152),
            text_hidden_size=config_field(text, "hidden_size", 4096),
            scale_factor=config_field(config, "scale_factor", 2),
        )

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[N, g*g, D] -> [N, g*g / s^2, D * s^2]: each s x s block of patches becomes one token.

        The same views/permutes as transformers' Idefics3Connector.pixel_shuffle (the feature order within a token
        is what the projection was trained on)."""
        s = self.scale_factor
        bsz, seq, dim = x.shape
        side = int(seq**0.5)
        if side * side != seq or side % s:
            raise ValueError(
                f"pixel shuffle needs a square patch grid with a side divisible by scale_factor={s}, got {seq} patches"
            )
        x = x.reshape(bsz, side, side // s, dim * s)
        x = x.permute(0, 2, 1, 3)
        x = x.reshape(bsz, side // s, side // s, dim * s * s)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(bsz, seq // (s * s), dim * s * s)

    def forward(self, image_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(self.pixel_shuffle(image_hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to the connector (`modality_projection.proj.weight`); strict like
        SiglipVisionTower.load_weights."""
        return load_module_weights(self, weights)


def idefics3_image_features(
    tower: SiglipVisionTower, connector: Idefics3Connector, pixel_values: torch.Tensor
) -> torch.Tensor:
    """Image-token embeddings [N, tokens, text_hidden] of N full images [N, C, image_size, image_size], with
    tokens = (image_size / patch_size)^2 / scale_factor^2 (one row per image, unlike transformers' flattened list)."""
    # Checked before running the tower, so a mismatched pair fails without spending the encoder's compute
    if tower.hidden_size != connector.vision_hidden_size:
        raise ValueError(
            f"vision tower hidden_size={tower.hidden_size} does not match the connector's "
            f"vision_hidden_size={connector.vision_hidden_size}"
        )
    if tower.num_patches_per_side % connector.scale_factor:
        raise ValueError(
            f"patch grid side {tower.num_patches_per_side} not divisible by scale_factor={connector.scale_factor}"
        )
    return connector(tower(pixel_values))
