"""Qwen2.5-VL's vision transformer: 14-pixel patches of two frames (a Conv3d over each), a 2-D rotary embedding per
patch (its row and column), RMS-normed SwiGLU blocks whose attention runs inside 112-pixel windows except on the
`fullatt_block_indexes` blocks (over the whole image), then the patch merger (each 2 x 2 block of patches to one
token of the text model's width).

The window order, the patches' positions and the attention segments come from transformers' own helpers
(`transformers.vision_utils`): they are the oracle, and their order is what the merger's output is read back in.
Names mirror transformers' Qwen2_5_VisionTransformerPretrainedModel, so checkpoint names map one to one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.models.vision.clip import config_field, get_activation, load_module_weights


class Qwen2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)
        c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()  # rotated in float32, as transformers does
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # each window (or the whole image) on its own
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs).squeeze(0).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: Any) -> None:
        super().__init__()
        self.norm1 = Qwen2RMSNorm(dim)
        self.norm2 = Qwen2RMSNorm(dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = Qwen2RMSNorm(context_dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen25VisionTower(nn.Module):
    """pixel patches [N, C * T * P * P] and their grid [[t, h, w]] -> [N / merge^2, text hidden]."""

    def __init__(self, config: Mapping[str, Any] | Any) -> None:
        super().__init__()
        f = {k: config_field(config, k, d) for k, d in (
            ("depth", 32), ("hidden_size", 1280), ("intermediate_size", 3420), ("num_heads", 16), ("in_channels", 3),
            ("patch_size", 14), ("temporal_patch_size", 2), ("spatial_merge_size", 2), ("window_size", 112),
            ("fullatt_block_indexes", [7, 15, 23, 31]), ("out_hidden_size", 3584), ("hidden_act", "silu"))}
        dim, heads = f["hidden_size"], f["num_heads"]
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision_config: hidden_size {dim} / num_heads {heads} is not a head size divisible by 4")
        self.in_channels, self.patch_size, self.temporal = f["in_channels"], f["patch_size"], f["temporal_patch_size"]
        self.merge, self.window_size = f["spatial_merge_size"], f["window_size"]
        self.full_blocks = set(f["fullatt_block_indexes"])
        kernel = (self.temporal, self.patch_size, self.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel_size=kernel, stride=kernel, bias=False)
        rope = config_field(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, Mapping) else 10000.0
        half = dim // heads // 2
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)),
                             persistent=False)
        act = get_activation(f["hidden_act"], "vision_config.hidden_act")
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, f["intermediate_size"], act) for _ in range(f["depth"]))
        self.merger = PatchMerger(f["out_hidden_size"], dim, self.merge)
        self.dim = dim

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        from transformers.vision_utils import (  # lazy: transformers' import is seconds; its helpers are the oracle
            get_vision_cu_seqlens,
            get_vision_position_ids,
            get_vision_window_index,
        )

        unit = self.merge * self.merge
        x = pixels.view(-1, self.in_channels, self.temporal, self.patch_size, self.patch_size)
        x = self.patch_embed.proj(x.to(self.patch_embed.proj.weight.dtype)).view(-1, self.dim)
        n = x.shape[0]
        if n != int(grid_thw.prod(-1).sum()):
            raise ValueError(f"{n} patches for an image grid of {grid_thw.tolist()}")
        window_index, cu_window = get_vision_window_index(grid_thw, self.merge, self.window_size, self.patch_size)
        cu_full = get_vision_cu_seqlens(grid_thw).tolist()
        cu_window = cu_window.tolist()
        pos = get_vision_position_ids(grid_thw, self.merge)  # [n, 2]: row, column
        freqs = pos[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]

        def windowed(t: torch.Tensor) -> torch.Tensor:  # into window order, 2 x 2 merge units kept together
            return t.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)

        x, cos, sin = windowed(x), windowed(emb.cos()), windowed(emb.sin())
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in self.full_blocks else cu_window, cos, sin)
        return self.merger(x)[torch.argsort(window_index)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_module_weights(self, weights)
