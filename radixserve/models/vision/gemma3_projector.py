"""Gemma 3's multimodal projector: the SigLIP tower's patch grid average-pooled down to `mm_tokens_per_image`
tokens (a 64 x 64 grid of 896 / 14 patches to 16 x 16 = 256), a Gemma RMS norm (weights as 1 + w), then one matrix
into the text model's width. The same ops, in the same order, as transformers' Gemma3MultiModalProjector."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from radixserve.models.vision.clip import config_field, load_module_weights


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in float32 (Gemma's norm: its weights are stored as w, centred on 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_image: int,
                 eps: float) -> None:
        super().__init__()
        side = int(round(tokens_per_image**0.5))
        if side < 1 or side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} is not a square whose side divides the "
                             f"vision tower's {patches_per_side} patches a side")
        self.patches_per_side, self.tokens_per_image = patches_per_side, tokens_per_image
        self.kernel = patches_per_side // side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> Gemma3MultiModalProjector:
        """From a Gemma3Config or its config.json dict (defaults as Gemma3Config's)."""
        vision = config_field(config, "vision_config") or {}
        text = config_field(config, "text_config") or {}
        size, patch = config_field(vision, "image_size", 224), config_field(vision, "patch_size", 16)
        return cls(config_field(vision, "hidden_size", 768), config_field(text, "hidden_size", 2304), size // patch,
                   config_field(config, "mm_tokens_per_image", 256), config_field(vision, "layer_norm_eps", 1e-6))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, patches_per_side^2, vision hidden] -> [N, tokens_per_image, text hidden]."""
        n, seq, hidden = patches.shape
        if seq != self.patches_per_side**2:
            raise ValueError(f"the projector takes {self.patches_per_side**2} patches an image, got {seq}")
        grid = patches.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side).contiguous()
        pooled = nn.functional.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)  # [N, tokens, hidden], row-major over the pooled grid
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to the projector (`mm_input_projection_weight`, `mm_soft_emb_norm.weight`); strict."""
        return load_module_weights(self, weights)
