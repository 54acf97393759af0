"""Build and load the C++ CPU attention kernel (csrc/paged_attention.cpp) on first use.

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

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
_NAME = "radixserve_cpu_attention"


@functools.lru_cache(maxsize=1)
def _build() -> tuple[Callable[..., None] | None, str]:
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
        return torch.ops.radixserve_cpu.paged_attention, ""
    except Exception as exc:  # noqa: BLE001  # no compiler, no ninja, a failed build: all mean "fall back"
        return None, f"{type(exc).__name__}: {exc}"


def load_paged_attention() -> tuple[Callable[..., None] | None, str]:
    """(kernel, "") once built or loaded; (None, reason) when this machine cannot build it."""
    kernel, reason = _build()
    if kernel is None:
        logger.warning("C++ paged attention unavailable, using the PyTorch path: %s", reason.splitlines()[0][:300])
    return kernel, reason
