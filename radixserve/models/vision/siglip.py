"""SigLIP ViT vision tower as Idefics3 / SmolVLM use it: the last encoder layer's hidden states after
`post_layernorm`, one token per patch (no class token, no pooling head).

Module names mirror transformers' Idefics3VisionTransformer (= SmolVLM's, = SiglipVisionTransformer without
its head) so checkpoint tensor names map one to one. Only full images of `image_size` are supported: the
processor resizes/splits every image to that size, so the patch attention mask is all ones."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from radixserve.models.vision.clip import (
    CLIPEncoder,
    config_field,
    get_activation,
    load_module_weights,
)

# Idefics3VisionConfig's (= SmolVLMVisionConfig's) defaults: config.json files omit fields left at their default
_SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# Plain SiglipVisionConfig's defaults differ from Idefics3's in these fields
_PLAIN_SIGLIP_MODEL_TYPE = "siglip_vision_model"
_PLAIN_SIGLIP_OVERRIDES: dict[str, Any] = {"hidden_size": 768, "num_attention_heads": 12, "patch_size": 16}


def _as_int_size(value: Any, field: str) -> int:
    """image_size / patch_size may be a pair in the config classes; only square ones are supported."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"unsupported non-square vision_config.{field}={value!r}")
        value = value[0]
    return int(value)


def navit_position_ids(num_patches_per_side: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids [g*g] that Idefics3VisionEmbeddings computes for a full image (all-ones patch mask).

    Its NaViT-style bucketing of fractional coordinates is NOT the identity arange for every grid size
    (float rounding: e.g. g = 19, 25, 29, 31 repeat and skip ids), so it is reproduced op for op, on the
    input's device like transformers does (float arange may round differently across devices)."""
    g = num_patches_per_side
    boundaries = torch.arange(1 / g, 1.0, 1 / g, device=device)
    nb_patches = torch.full((1,), g, device=device)  # the mask's row sum: an int64 tensor there
    step = 1.0 / nb_patches
    indices = torch.arange(g, device=device, dtype=torch.float32)
    fractional = torch.clamp(indices[None, :] * step[:, None], max=(1.0 - 1e-6))
    # Rows and columns bucket alike: the image is square
    buckets = torch.bucketize(fractional, boundaries, right=True)[0]
    return (buckets[:, None] * g + buckets[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(
        self, hidden_size: int, image_size: int, patch_size: int, num_channels: int, navit_positions: bool
    ) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_embedding = nn.Conv2d(
            num_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True
        )
        self.num_patches_per_side = image_size // patch_size
        self.num_patches = self.num_patches_per_side**2
        self.position_embedding = nn.Embedding(self.num_patches, hidden_size)
        # Idefics3 / SmolVLM bucket positions (navit_position_ids); plain SigLIP uses arange
        self.navit_positions = navit_positions

    def position_ids(self, device: torch.device) -> torch.Tensor:
        if self.navit_positions:
            return navit_position_ids(self.num_patches_per_side, device)
        return torch.arange(self.num_patches, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        _, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            # No variable-resolution support: the processor emits image_size tiles, anything else is a bug upstream
            raise ValueError(
                f"image size {h}x{w} does not match the vision tower's {self.image_size}x{self.image_size}"
            )
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, D, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [N, g*g, D], row-major over the grid
        return patches + self.position_embedding(self.position_ids(patches.device))


class SiglipVisionTower(nn.Module):
    """SigLIP ViT: [N, C, image_size, image_size] pixels -> [N, num_patches, hidden] (last layer, post-layernormed)."""

    def __init__(self, config: Mapping[str, Any] | Any) -> None:
        super().__init__()
        model_type = config_field(config, "model_type")
        defaults = dict(_SIGLIP_VISION_DEFAULTS)
        if model_type == _PLAIN_SIGLIP_MODEL_TYPE:
            defaults.update(_PLAIN_SIGLIP_OVERRIDES)
        f = {k: config_field(config, k, d) for k, d in defaults.items()}
        act = get_activation(f["hidden_act"], "vision_config.hidden_act")
        d = f["hidden_size"]
        self.image_size = _as_int_size(f["image_size"], "image_size")
        self.patch_size = _as_int_size(f["patch_size"], "patch_size")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision_config.image_size={self.image_size} not divisible by patch_size={self.patch_size}"
            )
        self.hidden_size: int = d
        self.embeddings = SiglipVisionEmbeddings(
            d,
            self.image_size,
            self.patch_size,
            f["num_channels"],
            navit_positions=model_type != _PLAIN_SIGLIP_MODEL_TYPE,
        )
        # The encoder layer is CLIP's exactly (pre-LN, q/k/v/out_proj with bias, fc1/fc2): same names, same math
        self.encoder = CLIPEncoder.from_fields(f, act)
        self.post_layernorm = nn.LayerNorm(d, eps=f["layer_norm_eps"])

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    @property
    def num_patches_per_side(self) -> int:
        return self.embeddings.num_patches_per_side

    @property
    def num_patches(self) -> int:
        return self.embeddings.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values must be [N, C, H, W], got shape {tuple(pixel_values.shape)}")
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tower-relative names (`embeddings...`, `encoder.layers.{i}...`, `post_layernorm...`), optionally
        under `vision_model.`; strict: unknown names, shape mismatches and missing parameters raise ValueError.

        A plain SigLIP checkpoint's pooling head (`head.*`) has no parameter here: filter it out beforehand."""
        return load_module_weights(self, weights, strip_prefixes=("vision_model.",))
