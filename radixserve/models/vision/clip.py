"""CLIP ViT vision tower, as LLaVA uses it: the hidden states of a chosen encoder layer, not the pooled output.

Module names mirror transformers' CLIPVisionModel so checkpoint tensor names map one to one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# CLIPVisionConfig's defaults: LLaVA config.json files omit the fields left at their default (hidden_act, eps, ...)
_CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# Only activations whose transformers definition we reproduce exactly ("gelu" is the exact erf form there)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name`; `field` names the config field in the error, so users know what to fix."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported {field}={name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def config_field(config: Mapping[str, Any] | Any, name: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or from a plain dict (a config.json sub-dict)."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def load_module_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    strip_prefixes: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters by exact name; strict both ways.

    Unknown names and shape mismatches raise at once (a wrong checkpoint should fail loudly, not half-load);
    parameters left unloaded raise at the end. `ignore` lists names that are legitimately in checkpoints
    but have no parameter here (derivable buffers)."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = ckpt_name
        for prefix in strip_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name in ignore:
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(module).__name__}"
            )
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                f"but {type(module).__name__}.{name} has shape {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"{type(module).__name__}: weights missing from the checkpoint: {missing}")
    return loaded


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, hidden_size: int, image_size: int, patch_size: int, num_channels: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.class_embedding = nn.Parameter(torch.zeros(hidden_size))  # overwritten by load_weights
        self.patch_embedding = nn.Conv2d(
            num_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=False
        )
        self.num_patches = (image_size // patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            # No position-embedding interpolation: the processor resizes to image_size, anything else is a bug upstream
            raise ValueError(
                f"image size {h}x{w} does not match the vision tower's {self.image_size}x{self.image_size}"
            )
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, D, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [N, g*g, D], row-major over the grid
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"vision_config.hidden_size={hidden_size} not divisible by num_attention_heads={num_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        # Bidirectional (no mask): every patch attends to every patch and the CLS token
        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), scale=self.scale
        )
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class CLIPMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        eps: float,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.self_attn = CLIPAttention(hidden_size, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = CLIPMLP(hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, layers: list[CLIPEncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    @classmethod
    def from_fields(cls, f: Mapping[str, Any], act: Callable[[torch.Tensor], torch.Tensor]) -> CLIPEncoder:
        """The encoder a vision config's fields describe (CLIP's and SigLIP's layers are the same)."""
        return cls([CLIPEncoderLayer(f["hidden_size"], f["intermediate_size"], f["num_attention_heads"],
                                     f["layer_norm_eps"], act) for _ in range(f["num_hidden_layers"])])


class CLIPVisionTower(nn.Module):
    """CLIP ViT returning per-layer hidden states (transformers' `hidden_states` indexing), not the pooled output."""

    def __init__(self, config: Mapping[str, Any] | Any) -> None:
        super().__init__()
        f = {k: config_field(config, k, d) for k, d in _CLIP_VISION_DEFAULTS.items()}
        act = get_activation(f["hidden_act"], "vision_config.hidden_act")
        d = f["hidden_size"]
        self.image_size: int = f["image_size"]
        self.patch_size: int = f["patch_size"]
        self.hidden_size: int = d
        self.embeddings = CLIPVisionEmbeddings(d, self.image_size, self.patch_size, f["num_channels"])
        self.pre_layrnorm = nn.LayerNorm(d, eps=f["layer_norm_eps"])  # (sic): the checkpoint's spelling
        self.encoder = CLIPEncoder.from_fields(f, act)
        # Unused by forward (it only feeds CLIP's pooled output) but in every checkpoint: kept so loading stays strict
        self.post_layernorm = nn.LayerNorm(d, eps=f["layer_norm_eps"])

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    @property
    def num_patches(self) -> int:
        """Image tokens per image without the CLS token (what LLaVA's "default" strategy keeps)."""
        return self.embeddings.num_patches

    def _resolve_layers(self, feature_layer: int | list[int]) -> list[int]:
        requested = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        if not requested:
            raise ValueError("vision_feature_layer: empty list of layers")
        n_states = self.num_layers + 1  # embeddings + one per encoder layer
        resolved = []
        for idx in requested:
            if not -n_states <= idx < n_states:
                raise ValueError(
                    f"vision_feature_layer {idx} out of range for {self.num_layers} encoder layers"
                )
            resolved.append(idx % n_states)
        return resolved

    def forward(self, pixel_values: torch.Tensor, feature_layer: int | list[int]) -> torch.Tensor:
        """Hidden states [N, 1 + num_patches, hidden * len(layers)] of the requested layer(s), concatenated in order.

        Index 0 is the (pre-layernormed) embeddings, i the output of encoder layer i, negative from the end."""
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values must be [N, C, H, W], got shape {tuple(pixel_values.shape)}")
        indices = self._resolve_layers(feature_layer)
        wanted = set(indices)
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        kept = {0: x} if 0 in wanted else {}  # only requested states are held, not one activation per layer
        # Layers past the deepest requested one cannot affect the result: LLaVA's -2 skips the last layer entirely
        for i, layer in enumerate(self.encoder.layers[: max(indices)], start=1):
            x = layer(x)
            if i in wanted:
                kept[i] = x
        if len(indices) == 1:
            return kept[indices[0]]
        return torch.cat([kept[i] for i in indices], dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tower-relative names (`embeddings...` as transformers 5 saves, or `vision_model.embeddings...` as
        older checkpoints do); strict: unknown names, shape mismatches and missing parameters raise ValueError."""
        # position_ids was a persistent buffer in older transformers, so old checkpoints carry it; it is just arange
        return load_module_weights(
            self, weights, strip_prefixes=("vision_model.",), ignore=("embeddings.position_ids",)
        )
