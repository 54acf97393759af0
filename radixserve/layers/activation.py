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


# The gated activations the engine implements, by ModelConfig.hidden_act (model_config.ACTIVATIONS maps configs'
# spellings onto these), in the C++ kernels' order: csrc/fused_experts.cpp's `act` is the index here.
GATED_ACTIVATIONS: dict[str, type[CpuKernelLayer]] = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}


def _known(name: str) -> str:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"no gated activation {name!r} (supported: {', '.join(GATED_ACTIVATIONS)})")
    return name


def gated_activation(name: str) -> nn.Module:
    """The gated MLP's activation module by name."""
    return GATED_ACTIVATIONS[_known(name)]()


def kernel_activation_id(name: str) -> int:
    """The activation's id in the C++ kernels (fused_experts' `act`)."""
    return list(GATED_ACTIVATIONS).index(_known(name))
