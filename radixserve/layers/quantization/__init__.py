"""Low-bit weights for the CPU decode path (`--quantization`): formats, conversions and the plan.

    qweight.py       the kernel kinds (KINDS, join_kinds), QuantRows (row-major values: quantise, stack,
                     shard) and QuantWeight (the kernels' 8-row interleaved layout)
    scale_factors.py the K-quants' two-level scales (super x int8 sub), kept through every row rule
    expert_slab.py   an MoE projection's experts repacked straight into their stacked [experts, ...] tensors
    gguf_formats.py  one record per GGUF tensor type: float, exact (its blocks -> a kernel kind without
                     loss) or re-quantised; the one list of types the loader accepts
    plan.py          which format each layer gets from `--quantization auto|int8|int4` and the checkpoint
"""

from radixserve.layers.quantization.qweight import (
    QBLOCK,
    QKIND_Q4_1,
    QKIND_Q8_0,
    QuantRows,
    QuantWeight,
)

__all__ = ["QBLOCK", "QKIND_Q4_1", "QKIND_Q8_0", "QuantRows", "QuantWeight"]
