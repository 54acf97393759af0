"""radixserve's C++ CPU kernels: sources in csrc/ (one per op family), built per CPU ISA by loader.py."""

from radixserve.kernels.cpu.loader import (
    load_cpu_ops,
    load_paged_attention,
    loaded_isa,
    native_bf16_matmul,
    selected_isa,
)

__all__ = ["load_cpu_ops", "load_paged_attention", "loaded_isa", "native_bf16_matmul", "selected_isa"]
