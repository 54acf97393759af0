"""RMSNorm with the residual add fused in (one pass instead of two over the hidden states)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        var = x.pow(2).mean(-1, keepdim=True)
        out = x * torch.rsqrt(var + self.eps) * self.weight
        return out if residual is None else (out, residual)
