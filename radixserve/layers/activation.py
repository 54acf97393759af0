"""SiLU(gate) * up on the merged gate_up projection output."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    cpu_ops: Any = None  # torch.ops.radixserve_cpu when the runner enabled the C++ CPU kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [n, 2 * inter] -> [n, inter]
        ops = self.cpu_ops
        if ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            ops.silu_and_mul(x, out)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
