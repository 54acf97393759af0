"""Low-bit weights for the CPU decode path (`--quantization`): formats, conversions and the plan.

    qweight.py   QuantRows (row-major Q8_0 / Q4_1: quantise, GGUF blocks, stacking) and QuantWeight
                 (the kernels' 8-row interleaved layout)
    plan.py      which format each layer gets from `--quantization auto|int8|int4` and the checkpoint
"""

from radixserve.layers.quantization.qweight import (
    QKIND_Q4_1,
    QKIND_Q8_0,
    QBLOCK,
    QuantRows,
    QuantWeight,
)

__all__ = ["QBLOCK", "QKIND_Q4_1", "QKIND_Q8_0", "QuantRows", "QuantWeight"]
