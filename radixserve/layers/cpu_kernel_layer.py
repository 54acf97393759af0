"""The one slot through which a layer reaches radixserve's C++ CPU kernels."""

from __future__ import annotations

from typing import Any

from torch import nn


class CpuKernelLayer(nn.Module):
    """A layer whose arithmetic has a C++ twin (RMSNorm, RoPE, the gated activations): `cpu_ops` is
    torch.ops.radixserve_cpu when the ModelRunner enabled the kernels, None for plain PyTorch. It is a base
    class, not an attribute found by name, so which layers take kernels is written in their class lines."""

    cpu_ops: Any = None


def enable_cpu_kernels(model: nn.Module, ops: Any | None) -> int:
    """Point every CpuKernelLayer of `model` at `ops` (None: plain PyTorch). The ModelRunner calls this once
    at load, when it chooses the attention backend, and never per step; returns how many layers were set."""
    layers = [mod for mod in model.modules() if isinstance(mod, CpuKernelLayer)]
    for mod in layers:
        mod.cpu_ops = ops
    return len(layers)


def kernel_ops(model: nn.Module) -> Any | None:
    """What enable_cpu_kernels gave `model`'s layers: the ops, or None (plain PyTorch, or no such layer)."""
    return next((mod.cpu_ops for mod in model.modules() if isinstance(mod, CpuKernelLayer)), None)
