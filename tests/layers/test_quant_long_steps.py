"""One precision whatever the step's size: a long step's rows (on the `amx` variant, AMX-INT8 tiles of 16 rows,
kernels/cpu/csrc/quant_amx.h; elsewhere the register tiles) equal, bit for bit, the same rows run one at a time
(a decode step's path), for every exact GGUF type, its scale layouts (flat float32, the file's float16,
factored), bias or not, and one or two threads. This is what makes the default mode batch-invariant on AMX."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.layers.quantization.gguf_formats import EXACT_TYPES
from tests.layers.test_quant_linear import assert_within_float_rounding, gguf_weight, needs_kernels, ops


def _run(qw, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], qw.n)
    ops.quant_linear(x.contiguous(), qw.kind, qw.n, qw.data, qw.d, qw.m, bias, out)
    return out


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(EXACT_TYPES)), n=st.integers(9, 72), supers=st.integers(1, 3),
       m=st.integers(16, 150), bias=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31))
def test_a_long_steps_rows_are_the_one_row_steps_bits(qtype, n, supers, m, bias, threads, seed) -> None:
    qw = gguf_weight(qtype, n, 256 * supers, seed % 1000)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 256 * supers, generator=g) * 3
    b = torch.randn(n, generator=g) if bias else None
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = _run(qw, x, b)
        assert_within_float_rounding(full, qw, x, b)
        for r in sorted({0, 15, 16, m // 2, m - 1}):  # first tile, its edge, the middle, the remainder
            assert torch.equal(_run(qw, x[r : r + 1], b), full[r : r + 1]), (qtype, r)
        # a chunk that starts mid-tile: other rows share its tiles
        assert torch.equal(_run(qw, x[3:], b), full[3:]), qtype
    finally:
        torch.set_num_threads(saved)
