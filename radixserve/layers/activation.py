"""Gated activations on the merged gate_up projection output: act(gate) * up."""

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


class GeluTanhAndMul(nn.Module):
    """GELU(gate, tanh approximation) * up: Gemma's gated MLP (transformers' gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gated MLP's activation by ModelConfig.hidden_act (the one list: model_config.ACTIVATIONS)."""
    if name == "silu":
        return SiluAndMul()
    if name == "gelu_tanh":
        return GeluTanhAndMul()
    raise ValueError(f"no gated activation {name!r} (supported: silu, gelu_tanh)")
