"""Build and load radixserve's C++ CPU kernels (csrc/cpu_kernels.cpp) on first use.

`torch.ops.radixserve_cpu` then holds `paged_attention` (the cpu_paged attention backend),
`paged_attention_varlen` (every forward mode, for --enable-deterministic-inference) and the
decoder-layer glue `fused_add_rms_norm_`, `rope_`, `silu_and_mul` that RMSNorm, RotaryEmbedding and
SiluAndMul use once `enable_cpu_kernels(model, ops)` has marked them (ModelRunner does this when
the attention backend is cpu_paged).

The kernel is compiled with torch.utils.cpp_extension into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR): the first build takes ~30-60 s on two cores,
later processes load the cached library in about a second. A machine without a C++ compiler gets
`None` from `load_paged_attention()` plus the reason, and the caller falls back to plain PyTorch.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cpu_kernels.cpp")
_NAME = "radixserve_cpu_kernels"


@functools.lru_cache(maxsize=1)
def _build() -> tuple[Any | None, str]:
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=_NAME,
            sources=[_SOURCE],
            # -march=native: the library is built on, and cached for, the machine that runs it.
            # -ffast-math: lets GCC vectorise the softmax's expf (libmvec); the kernel has no inf/NaN logic.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return torch.ops.radixserve_cpu, ""
    except Exception as exc:  # noqa: BLE001  # no compiler, no ninja, a failed build: all mean "fall back"
        return None, f"{type(exc).__name__}: {exc}"


def load_cpu_ops() -> tuple[Any | None, str]:
    """(torch.ops.radixserve_cpu, "") once built or loaded; (None, reason) when this machine cannot build it."""
    ops, reason = _build()
    if ops is None:
        logger.warning("C++ CPU kernels unavailable, using the PyTorch paths: %s", reason.splitlines()[0][:300])
    return ops, reason


def load_paged_attention() -> tuple[Callable[..., None] | None, str]:
    """(the paged attention kernel, "") or (None, reason)."""
    ops, reason = load_cpu_ops()
    return (None if ops is None else ops.paged_attention), reason


def enable_cpu_kernels(model: torch.nn.Module, ops: Any | None) -> int:
    """Point every module with a `cpu_ops` slot (RMSNorm, RotaryEmbedding, SiluAndMul) at `ops`
    (None switches them back to plain PyTorch); returns how many modules were set."""
    count = 0
    for mod in model.modules():
        if hasattr(mod, "cpu_ops"):
            mod.cpu_ops = ops
            count += 1
    return count


if __name__ == "__main__":
    # `python -m radixserve.layers.attention.cpu_kernels`: build (or load) the kernel now, e.g. from
    # `make setup`, so the first server start does not pay for the compile. Never fails set-up.
    built, why = load_cpu_ops()
    print("radixserve C++ CPU kernels:", "ready" if built is not None else f"unavailable ({why.splitlines()[0][:200]})")
