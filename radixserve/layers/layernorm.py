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
        # One fused kernel instead of pow/mean/add/rsqrt/mul/mul: at batch 1 these small ops were
        # ~10% of a decode step on CPU (61 norms per step for a 30-layer model).
        out = torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)
