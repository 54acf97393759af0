"""Low-bit weights (layers/quantization/, kernels/cpu/csrc/quant_linear.cpp): every kernel kind against a
float reference on random shapes (quantised float weights, and random blocks of every exact GGUF type),
the interleaved layout's round trip, the few-row dispatch, and bad shapes refused with the layer named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops, loaded_isa
from radixserve.layers.kernel_mode import KernelMode
from radixserve.layers.linear import PackableLinear
from radixserve.layers.quantization.gguf_formats import EXACT_TYPES, FORMATS
from radixserve.layers.quantization.qweight import (
    KINDS,
    QBLOCK,
    QKIND_Q4_1,
    QKIND_Q5,
    QKIND_Q6,
    QKIND_Q8_0,
    QKIND_Q8_16,
    QKIND_Q8_M,
    QuantRows,
    QuantWeight,
    join_kinds,
)
from tests.layers.test_gguf_formats import SCALE_OFFSETS, random_blocks

ops, why = load_cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None or not hasattr(ops, "quant_linear"), reason=f"no C++ kernels: {why}")


def _act_reference(x: torch.Tensor) -> torch.Tensor:
    """x after the kernels' activation quantisation, step for step (int8 per 32-block, d = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)): x / d would round a few ties the other way)."""
    m, k = x.shape
    xb = x.reshape(m, k // QBLOCK, QBLOCK)
    amax = xb.abs().amax(2, keepdim=True)
    d = amax / 127
    # a tensor division: torch's `127 / amax` is reciprocal(amax) * 127, another rounding
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * d).reshape(m, k)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from([QKIND_Q8_0, QKIND_Q4_1]), n=st.integers(1, 70), blocks=st.integers(1, 12),
       m=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 13, 64, 70]), bias=st.booleans(), seed=st.integers(0, 1000))
def test_kernel_matches_the_dequantised_reference(kind, n, blocks, m, bias, seed) -> None:
    k = blocks * QBLOCK
    g = torch.Generator().manual_seed(seed)
    qw = QuantWeight.quantize(torch.randn(n, k, generator=g), kind)
    x = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, generator=g) if bias else None
    out = torch.empty(m, n)
    ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, b, out)
    ref = _act_reference(x) @ qw.dequantize().T + (b if b is not None else 0)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-4)


def gguf_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    """Random (valid) blocks of `qtype` for an n x k matrix, as the kernels' layout."""
    bs = FORMATS[qtype].block_size
    return QuantWeight.from_rows(FORMATS[qtype].rows(random_blocks(qtype, n, k // bs, seed)))


def assert_within_float_rounding(out: torch.Tensor, qw: QuantWeight, x: torch.Tensor, bias=None) -> None:
    """out == (dequantised weights) . (quantised activations), in float64, up to float32 rounding of the
    kernel's per-scale-group steps: 2^-18 of the sum of |products| (|d q| + |m| per weight) bounds it."""
    rows = qw.to_rows()
    n, k = rows.q.shape
    g = rows.group
    xa = _act_reference(x).double()
    ref = xa @ rows.dequantize().double().T + (bias.double() if bias is not None else 0)
    mag = (rows.q.double().view(n, k // g, g) * rows.d.double()[:, :, None]).abs()
    if rows.m is not None:
        mag = mag + rows.m.double().abs()[:, :, None]
    bound = xa.abs() @ mag.view(n, k).T * 2.0**-18 + (bias.double().abs() if bias is not None else 0) * 2.0**-22
    err = (out.double() - ref).abs()
    assert (err <= bound + 1e-30).all(), f"max excess {(err - bound).max().item():.3g}"


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(sorted(EXACT_TYPES)), n=st.integers(1, 40), supers=st.integers(1, 3),
       m=st.sampled_from([1, 2, 3, 4, 5, 9]), bias=st.booleans(), seed=st.integers(0, 2**31))
def test_every_gguf_type_multiplies_as_its_dequantised_weights(qtype, n, supers, m, bias, seed) -> None:
    """Random blocks, so every int value occurs (Q8_0's -128, Q3_K's folded -128..124, IQ4 grids)."""
    qw = gguf_weight(qtype, n, 256 * supers, seed)
    assert qw.kind == FORMATS[qtype].kind
    g = torch.Generator().manual_seed(seed % 1000)
    x = torch.randn(m, 256 * supers, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = torch.empty(m, n)
    ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, b, out)
    assert_within_float_rounding(out, qw, x, b)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from([QKIND_Q8_0, QKIND_Q4_1]), n=st.integers(1, 40), blocks=st.integers(1, 5),
       seed=st.integers(0, 100))
def test_interleaved_layout_round_trips(kind, n, blocks, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = QuantRows.quantize(torch.randn(n, blocks * QBLOCK, generator=g), kind)
    back = QuantWeight.from_rows(rows).to_rows()
    assert torch.equal(back.q, rows.q) and torch.equal(back.d, rows.d)
    assert (back.m is None) == (rows.m is None) and (rows.m is None or torch.equal(back.m, rows.m))


@pytest.mark.parametrize("kind,bound", [(QKIND_Q8_0, 1 / 254), (QKIND_Q4_1, 1 / 30)])
def test_quantisation_error_is_within_half_a_step(kind, bound) -> None:
    w = torch.randn(64, 256)
    rows = QuantRows.quantize(w, kind)
    err = (rows.dequantize() - w).abs().reshape(64, -1, QBLOCK).amax(2)
    span = w.reshape(64, -1, QBLOCK)
    span = span.abs().amax(2) * 2 if kind == QKIND_Q8_0 else span.amax(2) - span.amin(2)
    assert (err <= span * bound * 1.0001 + 1e-7).all()


def test_bad_shapes_are_refused_naming_the_layer() -> None:
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.down_proj .*8x48.*not a multiple of .*32"):
        QuantWeight.quantize(torch.randn(8, 48), QKIND_Q4_1, "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="different kinds"):
        QuantRows.cat([QuantRows.quantize(torch.randn(8, 32), QKIND_Q8_0),
                       QuantRows.quantize(torch.randn(8, 32), QKIND_Q4_1)])


def rows_of_kind(kind: int, n: int, k: int, seed: int) -> QuantRows:
    """Random n x k weights held in kernel kind `kind`: quantised floats, or valid random blocks of a GGUF
    type that maps to it (Q8_M, Q8_16: no type maps to these now, so Q5_1's / Q6_K's rows promoted)."""
    if kind in (QKIND_Q8_0, QKIND_Q4_1):
        return QuantRows.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), kind)
    if kind in (QKIND_Q8_M, QKIND_Q8_16):
        src = "Q5_1" if kind == QKIND_Q8_M else "Q6_K"
        return FORMATS[src].rows(random_blocks(src, n, k // FORMATS[src].block_size, seed)).promote(kind)
    src = next(t for t in sorted(EXACT_TYPES) if FORMATS[t].kind == kind)
    return FORMATS[src].rows(random_blocks(src, n, k // FORMATS[src].block_size, seed))


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rows_result_does_not_depend_on_the_other_rows(kind) -> None:
    """Rows go 4 at a time against each weight block, each with its own accumulators: a row's output is
    bit for bit the same alone, in a tile remainder, or in a batch of 70 (batch invariance of `auto`)."""
    g = torch.Generator().manual_seed(kind)
    qw = QuantWeight.from_rows(rows_of_kind(kind, 100, 256, kind))
    x = torch.randn(70, 256, generator=g)
    full = torch.empty(70, 100)
    ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, full)
    for lo, hi in [(0, 1), (5, 6), (3, 6), (61, 70), (64, 65)]:
        part = torch.empty(hi - lo, 100)
        ops.quant_linear(x[lo:hi].contiguous(), qw.kind, qw.n, qw.data, qw.d, qw.m, None, part)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("factored", [False, True])
def test_a_groups_result_does_not_depend_on_its_neighbours(kind, factored) -> None:
    """The avx512vnni build runs two 8-row groups in one zmm register, and which groups pair depends on the
    threads' split and on where a matrix ends: each group's outputs are the same bits paired (groups 0-1 of
    24 rows), alone (the last of 24, or an 8-row matrix), or paired the other way (rows 8-24), at every
    tile size of activation rows, on one thread or two."""
    if factored and kind not in (QKIND_Q4_1, QKIND_Q6):
        pytest.skip("only Q4_K's (Q4_1) and Q6_K's (Q6) scales are factored")
    k = 512
    if factored:
        src = "Q4_K" if kind == QKIND_Q4_1 else "Q6_K"
        rows = FORMATS[src].rows(random_blocks(src, 24, k // 256, kind))
        assert rows.factors is not None
    else:
        rows = dataclasses.replace(rows_of_kind(kind, 24, k, kind), factors=None)
    threads = torch.get_num_threads()
    try:
        for m in (1, 2, 5, 8, 13):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))

            def run(start: int, length: int) -> torch.Tensor:
                qw = QuantWeight.from_rows(rows.narrow(0, start, length))
                assert qw.factored == factored
                out = torch.empty(m, length)
                ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out)
                return out

            for t in (1, 2):
                torch.set_num_threads(t)
                full = run(0, 24)
                assert torch.equal(run(8, 16), full[:, 8:]), (m, t)
                for g in range(3):
                    assert torch.equal(run(8 * g, 8), full[:, 8 * g : 8 * g + 8]), (m, t, g)
                assert torch.equal(run(0, 13), full[:, :13]), (m, t)  # a partial second group
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q5_K"])
@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 30), supers=st.integers(1, 2), seed=st.integers(0, 2**31))
def test_5_bit_types_pack_into_q5_and_back(qtype, n, supers, seed) -> None:
    """The packed layout (low nibbles + a plane of fifth bits) holds every value 0..31 and round-trips."""
    raw = random_blocks(qtype, n, 256 * supers // FORMATS[qtype].block_size, seed)
    rows = FORMATS[qtype].rows(raw)
    assert rows.kind == QKIND_Q5 and rows.q.dtype == torch.uint8 and int(rows.q.max()) <= 31
    qw = QuantWeight.from_rows(rows)
    assert qw.data.shape == (-(-n // 8), 256 * supers // QBLOCK * 160)
    back = qw.to_rows()
    assert torch.equal(back.q, rows.q) and torch.equal(back.d, rows.d) and torch.equal(back.m, rows.m)
    assert torch.equal(qw.dequantize(), torch.from_numpy(FORMATS[qtype].dequantize(raw).reshape(n, -1)))


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 9])
def test_q5_computes_the_same_bits_as_the_8_bit_kind(qtype, m) -> None:
    """Q5 forms the same exact integer sums as Q8_M (the kind these types took before) and then the same
    float steps in the same order, so the two outputs are equal bit for bit, besides being within float
    rounding of the dequantised product. Q4_1 rows held by Q5 (a q/k/v join) equal Q4_1's kernel too.
    (On the vector variants: the generic loops are reassociated by -ffast-math, so there only the rounding
    bound holds.)"""
    n, k = 37, 512
    rows = FORMATS[qtype].rows(random_blocks(qtype, n, k // FORMATS[qtype].block_size, m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
    out = {}
    for kind in (QKIND_Q5, QKIND_Q8_M):
        qw = QuantWeight.from_rows(rows.promote(kind))
        out[kind] = torch.empty(m, n)
        ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out[kind])
    assert_within_float_rounding(out[QKIND_Q5], QuantWeight.from_rows(rows), x)
    same_bits = loaded_isa() != "generic"
    assert torch.equal(out[QKIND_Q5], out[QKIND_Q8_M]) or not same_bits
    q4 = QuantRows.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(m)), QKIND_Q4_1)
    for kind in (QKIND_Q4_1, QKIND_Q5):
        qw = QuantWeight.from_rows(q4.promote(kind))
        out[kind] = torch.empty(m, n)
        ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out[kind])
    assert_within_float_rounding(out[QKIND_Q5], QuantWeight.from_rows(q4), x)
    assert torch.equal(out[QKIND_Q5], out[QKIND_Q4_1]) or not same_bits


@needs_kernels
def test_kernel_refuses_mismatched_tensors() -> None:
    qw = QuantWeight.quantize(torch.randn(16, 64), QKIND_Q4_1)
    with pytest.raises(RuntimeError, match="elements"):  # data of a 16 x 64 matrix used as 16 x 96
        ops.quant_linear(torch.randn(1, 96), qw.kind, qw.n, qw.data, qw.d, qw.m, None, torch.empty(1, 16))
    with pytest.raises(RuntimeError, match="needs its mins"):
        ops.quant_linear(torch.randn(1, 64), qw.kind, qw.n, qw.data, qw.d, None, None, torch.empty(1, 16))
    with pytest.raises(RuntimeError, match="unknown weight kind"):
        ops.quant_linear(torch.randn(1, 64), 7, qw.n, qw.data, qw.d, qw.m, None, torch.empty(1, 16))


@needs_kernels
def test_steps_up_to_the_cap_take_the_low_bit_path() -> None:
    lin = PackableLinear()
    w = torch.randn(64, 128)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    lin.qweight = QuantWeight.quantize(w, QKIND_Q4_1)
    cap = 4
    few, many = torch.randn(cap, 128), torch.randn(cap + 1, 128)
    exact_few, exact_many = lin.matmul(few), lin.matmul(many)  # no mode: float32
    torch.testing.assert_close(exact_few, few @ w.T)
    capped = KernelMode(ops, cap)
    q_few, q_many = lin.matmul(few, None, capped), lin.matmul(many, None, capped)
    every = KernelMode(ops, None)  # no cap: every step
    assert not torch.equal(lin.matmul(many, None, every), exact_many)
    assert not torch.equal(q_few, exact_few)  # the low-bit kernel ran
    assert ((q_few - exact_few).norm() / exact_few.norm()).item() < 0.15  # 4-bit weights: close, not equal
    assert torch.equal(q_many, exact_many)  # more rows stay on the float32 path


def test_server_args_bounds() -> None:
    from radixserve.server_args import ServerArgs

    for bad in ("int3", "", "AUTO", "q4_k" * 1000):
        with pytest.raises(ValueError, match="quantization"):
            ServerArgs(quantization=bad)
    for mode in ("int8", "int4"):
        with pytest.raises(ValueError, match="quantization"):
            ServerArgs(quantization=mode, enable_deterministic_inference=True)
        with pytest.raises(ValueError, match="quantization"):
            ServerArgs(quantization=mode, device="cuda")
        ServerArgs(quantization=mode, dtype="bfloat16")  # CPU bf16: float32 activations, the kernels take them
    assert ServerArgs().quantization == "auto"
    ServerArgs(quantization="auto", enable_deterministic_inference=True)  # auto resolves to none there


FACTORED_TYPES = sorted(t for t in EXACT_TYPES if FORMATS[t].factors is not None)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(FACTORED_TYPES), n=st.integers(1, 40), supers=st.integers(1, 3),
       m=st.sampled_from([1, 2, 4, 5, 9, 33]), seed=st.integers(0, 2**31))
def test_factored_scales_compute_the_flat_scales_bits(qtype, n, supers, m, seed) -> None:
    """The K-quants' scales as the file's factors (super-scale x int8 sub-scale, scale_factors.py) form the
    float32 products the flat layout stores, so the kernel's output is the same, bit for bit, in fewer bytes
    (Q4_K: 4.75 bits a weight instead of 6). On the generic loops -ffast-math reassociates the flat path's
    scale products, so there both are only within float rounding of the dequantised product."""
    rows = FORMATS[qtype].rows(random_blocks(qtype, n, supers * 256 // FORMATS[qtype].block_size, seed))
    assert rows.factors is not None
    fact = QuantWeight.from_rows(rows)
    flat = QuantWeight.from_rows(dataclasses.replace(rows, factors=None))
    assert fact.factored and not flat.factored and fact.nbytes() < flat.nbytes()
    assert torch.equal(fact.dequantize(), flat.dequantize())
    x = torch.randn(m, 256 * supers, generator=torch.Generator().manual_seed(seed % 1000))
    out = {w.factored: torch.empty(m, n) for w in (fact, flat)}
    for w in (fact, flat):
        ops.quant_linear(x, w.kind, w.n, w.data, w.d, w.m, None, out[w.factored])
        assert_within_float_rounding(out[w.factored], w, x)
    assert torch.equal(out[True], out[False]) or loaded_isa() == "generic"


def test_factors_survive_what_survives_and_drop_otherwise() -> None:
    """Row slices, padding, stacking and promotion keep the factors; a K split off the 256 boundaries and a
    part without factors drop them (to the flat scales, still exact); a lying block's NaN scales never factor
    into a different value (test_a_lying_blocks_nan_or_inf_scales_compute_as_the_flat_ones)."""
    a = FORMATS["Q4_K"].rows(random_blocks("Q4_K", 12, 2, 1))
    b = FORMATS["Q6_K"].rows(random_blocks("Q6_K", 8, 2, 2))
    legacy = FORMATS["Q5_0"].rows(random_blocks("Q5_0", 4, 16, 3))
    kind, joined = FORMATS["Q4_K"].kind, join_kinds([a.kind, b.kind])
    for r in (a.narrow(0, 3, 5), a.narrow(1, 256, 256), a.pad_rows(17), QuantRows.cat([a, a.narrow(0, 0, 4)]),
              QuantRows.cat([a.promote(joined), b.promote(joined)])):
        assert r.factors is not None
        assert torch.equal(QuantWeight.from_rows(r).dequantize(), r.dequantize())
    assert a.narrow(1, 32, 256).factors is None and QuantRows.cat([a.promote(QKIND_Q5), legacy]).factors is None
    assert a.promote(kind).factors is a.factors


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_a_lying_blocks_nan_or_inf_scales_compute_as_the_flat_ones(fmt) -> None:
    """A file's block with a NaN or inf super-scale: the weight as built (factored where the factors verify) and
    its flat twin give the kernel's same outputs, NaN where the flat scales make NaN and the same values
    elsewhere (bit for bit on the vector variants)."""
    n, k, m = 16, 512, 3
    blocks = random_blocks(fmt, n, k // 256, 4)
    d_at = SCALE_OFFSETS[fmt][0]  # the first block's float16 super-scale d
    for row, bad in ((0, np.nan), (5, np.inf), (9, -np.inf)):
        blocks[row, d_at : d_at + 2] = np.array([bad], np.float16).view(np.uint8)
    rows = FORMATS[fmt].rows(blocks)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    out = []
    for r in (rows, dataclasses.replace(rows, factors=None)):
        qw = QuantWeight.from_rows(r)
        out.append(torch.empty(m, n))
        ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out[-1])
    assert QuantWeight.from_rows(rows).factored  # the good super-blocks kept their factors
    assert torch.equal(out[0].isnan(), out[1].isnan()) and out[1][:, [0, 5, 9]].isnan().all()
    finite = ~out[1].isnan()
    if loaded_isa() != "generic":
        assert torch.equal(out[0][finite], out[1][finite])
    else:
        torch.testing.assert_close(out[0][finite], out[1][finite], rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("factored", [False, True])
def test_q6_computes_the_same_bits_as_q8_16(m, factored) -> None:
    """Q6_K's blocks as Q6 (6 bits a value) form the integer sums of Q8_16 (the kind Q6_K took before, 8 bits
    a value) and the same float steps in the same order: equal outputs, bit for bit, on the vector variants."""
    n, k = 37, 512
    rows = FORMATS["Q6_K"].rows(random_blocks("Q6_K", n, k // 256, m))
    if not factored:
        rows = dataclasses.replace(rows, factors=None)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
    out = {}
    for kind in (QKIND_Q6, QKIND_Q8_16):
        qw = QuantWeight.from_rows(rows.promote(kind))
        assert qw.factored == factored and torch.equal(qw.dequantize(), rows.dequantize())
        out[kind] = torch.empty(m, n)
        ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out[kind])
        assert_within_float_rounding(out[kind], qw, x)
    q6 = QuantWeight.from_rows(rows)
    assert q6.kind == QKIND_Q6 and q6.data.numel() == 8 * -(-n // 8) * k * 6 // 8
    assert torch.equal(out[QKIND_Q6], out[QKIND_Q8_16]) or loaded_isa() == "generic"


LEGACY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(LEGACY_TYPES), n=st.integers(1, 40), blocks=st.integers(1, 12),
       m=st.sampled_from([1, 2, 3, 5, 8, 9, 17]), seed=st.integers(0, 2**31))
def test_float16_scales_give_the_float32_layouts_bits(qtype, n, blocks, m, seed) -> None:
    """The legacy types keep the file's float16 scales (and mins: Q4_0's -8 d is one too): the kernels widen
    them to the float32 the flat layout held, so every row count gives the same bits at 2 bytes a scale."""
    qw = gguf_weight(qtype, n, 32 * blocks, seed)
    rows = qw.to_rows()
    # float16 unless a value is not one (random blocks reach Q4_0's -8 d past float16's 65504: kept float32)
    fits = all(torch.equal(t.half().float(), t) for t in (rows.d, rows.m) if t is not None)
    assert qw.d.dtype == (torch.float16 if fits else torch.float32)
    assert qw.m is None or qw.m.dtype == qw.d.dtype
    wide = dataclasses.replace(qw, d=qw.d.float(), m=None if qw.m is None else qw.m.float())
    assert wide.nbytes() > qw.nbytes() or not fits
    x = torch.randn(m, 32 * blocks, generator=torch.Generator().manual_seed(seed % 1000))
    out_h, out_f = torch.empty(m, n), torch.empty(m, n)
    ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, out_h)
    ops.quant_linear(x, wide.kind, wide.n, wide.data, wide.d, wide.m, None, out_f)
    assert torch.equal(out_h, out_f)
    torch.testing.assert_close(qw.to_rows().dequantize(), wide.to_rows().dequantize(), rtol=0, atol=0)


def test_scales_stay_float32_where_float16_would_round() -> None:
    """Scales quantised at run time (int8 / int4 modes) are not float16 values: kept float32, never rounded."""
    qw = QuantWeight.quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(3)), QKIND_Q4_1)
    assert qw.d.dtype == torch.float32 and qw.m.dtype == torch.float32
    mixed = QuantWeight.cat_groups([gguf_weight("Q4_1", 8, 64, 1), qw])  # a float16 piece beside a float32 one
    assert mixed.d.dtype == torch.float32 and mixed.m.dtype == torch.float32
    torch.testing.assert_close(mixed.to_rows().dequantize()[:8], gguf_weight("Q4_1", 8, 64, 1).dequantize(),
                               rtol=0, atol=0)
