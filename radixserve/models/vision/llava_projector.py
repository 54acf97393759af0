"""LLaVA-1.5's 2-layer MLP projector, and the vision-tower -> projector path that turns pixels into the
embeddings that replace the image placeholder tokens in the prompt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from radixserve.models.vision.clip import CLIPVisionTower, config_field, get_activation, load_module_weights

SELECT_STRATEGIES = ("default", "full")


class LlavaMultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden_size: int,
        text_hidden_size: int,
        num_feature_layers: int = 1,
        bias: bool = True,
        hidden_act: str = "gelu",
    ) -> None:
        super().__init__()
        # Several feature layers are concatenated on the hidden dim before projection, so the input widens
        self.linear_1 = nn.Linear(vision_hidden_size * num_feature_layers, text_hidden_size, bias=bias)
        self.act = get_activation(hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=bias)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> LlavaMultiModalProjector:
        """From a transformers LlavaConfig or its config.json dict (defaults as LlavaConfig's)."""
        vision = config_field(config, "vision_config")
        text = config_field(config, "text_config")
        layer = config_field(config, "vision_feature_layer", -2)
        return cls(
            vision_hidden_size=config_field(vision, "hidden_size", 1024),
            text_hidden_size=config_field(text, "hidden_size", 4096),
            num_feature_layers=1 if isinstance(layer, int) else len(layer),
            bias=config_field(config, "multimodal_projector_bias", True),
            hidden_act=config_field(config, "projector_hidden_act", "gelu"),
        )

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to the projector (`linear_1.weight`, ...); strict like CLIPVisionTower.load_weights."""
        return load_module_weights(self, weights)


def llava_image_features(
    tower: CLIPVisionTower,
    projector: LlavaMultiModalProjector,
    pixel_values: torch.Tensor,
    feature_layer: int | list[int],
    select_strategy: str,
) -> torch.Tensor:
    """Projected image embeddings [N, tokens, text_hidden]: tokens = num_patches ("default": CLS dropped) or
    num_patches + 1 ("full")."""
    # Checked before running the tower, so a bad config fails without spending the encoder's compute
    if select_strategy not in SELECT_STRATEGIES:
        raise ValueError(
            f"unsupported vision_feature_select_strategy={select_strategy!r}; supported: {list(SELECT_STRATEGIES)}"
        )
    features = tower(pixel_values, feature_layer)
    if select_strategy == "default":
        # CLS is position 0 of every layer, so dropping it after concatenation equals transformers' per-layer crop
        features = features[:, 1:]
    return projector(features)
