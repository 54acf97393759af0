"""Gated activations on the merged gate_up projection output: act(gate) * up."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernel_layer import CpuKernelLayer


def _native(ops: Any, op_name: str, x: torch.Tensor) -> torch.Tensor | None:
    """[n, 2 * inter] -> [n, inter] through the C++ op `op_name` (the one the native decode stack runs,
    so both paths compute the same floats), or None where it does not apply."""
    if ops is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        return None
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    getattr(ops, op_name)(x, out)
    return out


class SiluAndMul(CpuKernelLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _native(self.cpu_ops, "silu_and_mul", x)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(CpuKernelLayer):
    """GELU(gate, tanh approximation) * up: Gemma's gated MLP (transformers' gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _native(self.cpu_ops, "gelu_tanh_and_mul", x)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gated MLP's activation by ModelConfig.hidden_act (the one list: model_config.ACTIVATIONS)."""
    if name == "silu":
        return SiluAndMul()
    if name == "gelu_tanh":
        return GeluTanhAndMul()
    raise ValueError(f"no gated activation {name!r} (supported: silu, gelu_tanh)")
