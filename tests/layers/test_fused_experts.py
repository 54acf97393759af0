"""The fused-experts kernel (kernels/cpu/csrc/fused_experts.cpp) against the per-expert reference: each
(token, slot) pair through its expert's gate_up and down as two plain quant_linear calls (the kernel's own
per-row arithmetic, one expert at a time) with the activation between, weighted and summed per token in
slot order. Random routings and shapes, every exact GGUF block type (so every kernel kind) for the
experts, hot / dead experts, another expert-parallel rank's experts, and bad arguments refused.
test_kernel_isa.py runs `check_every_kind` under every ISA variant this CPU has."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.quantization.gguf_formats import EXACT_TYPES, FORMATS
from radixserve.layers.quantization.qweight import KINDS, ExpertQuantWeight, QuantRows, QuantWeight
from radixserve.layers.quantization.scale_factors import ScaleFactors
from tests.layers.test_gguf_formats import random_blocks

ops, why = load_cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None or not hasattr(ops, "fused_experts"), reason=f"no C++ kernels: {why}")


def expert_weights(qtype: str | int, experts: int, n: int, k: int, seed: int, kind: int | None = None) -> ExpertQuantWeight:
    """`experts` random [n, k] matrices: valid random blocks of a GGUF type (in `kind` when given: a kind that
    covers the type's), or a kernel kind (int) quantised from Gaussian weights."""
    out = []
    for e in range(experts):
        if isinstance(qtype, int):
            g = torch.Generator().manual_seed(seed * 131 + e)
            out.append(QuantWeight.quantize(torch.randn(n, k, generator=g) * 0.1, qtype))
            continue
        fmt = FORMATS[qtype]
        rows: QuantRows = fmt.rows(random_blocks(qtype, n, k // fmt.block_size, seed * 131 + e))
        # random blocks have scales up to float16's range: bring them to a model's size so the products
        # stay well inside float32 (the comparison is of summation order, not of overflow), by a power of
        # two so the K-quants' factored scales still multiply to the flat ones exactly (and stay factored)
        scale = 2.0 ** math.floor(math.log2(1e-2 / max(float(rows.d.abs().max()), 1e-30)))
        f = rows.factors
        if f is not None:
            f = ScaleFactors(f.d_super * scale, f.d_sub, None if f.m_super is None else f.m_super * scale, f.m_sub)
        rows = QuantRows(rows.kind, rows.q, rows.d * scale, None if rows.m is None else rows.m * scale, f)
        out.append(QuantWeight.from_rows(rows.promote(kind if kind is not None else rows.kind)))
    return ExpertQuantWeight.stack(out)


def run_kernel(x, ids, weights, w13, w2, act=0, offset=0) -> torch.Tensor:
    out = torch.empty_like(x)
    ops.fused_experts(x, ids, weights, offset, w13.kind, w13.n, w13.data, w13.d, w13.m, w2.kind, w2.data, w2.d,
                      w2.m, act, out)
    return out


def reference(x, ids, weights, w13, w2, act=0, offset=0) -> torch.Tensor:
    """Pair by pair through the plain quant_linear op, each token's slots summed in slot order."""
    out = torch.zeros_like(x)
    inter = w13.n // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - offset
            if not 0 <= e < w13.num_experts:
                continue  # another rank's expert
            a, b = w13.expert(e), w2.expert(e)
            h = torch.empty(1, w13.n)
            ops.quant_linear(x[t : t + 1].contiguous(), a.kind, a.n, a.data, a.d, a.m, None, h)
            # the kernel's activation is the C++ op the dense MLP runs (checked against torch in
            # test_cpu_kernels); torch's own silu / gelu differ in the last bit on some ISAs, and a one-ulp
            # change can move the down projection's int8 activation by a step.
            mid = torch.empty(1, inter)
            (ops.silu_and_mul if act == 0 else ops.gelu_tanh_and_mul)(h, mid)
            y = torch.empty(1, w2.n)
            ops.quant_linear(mid.contiguous(), b.kind, b.n, b.data, b.d, b.m, None, y)
            out[t] += weights[t, j] * y[0]
    return out


def routing(tokens: int, experts: int, k: int, seed: int, hot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `hot` in every token's top-k when given."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if hot is not None:
        for t in range(tokens):
            if hot not in ids[t]:
                ids[t, 0] = hot
    return ids.contiguous(), torch.rand(tokens, k, generator=g)


def check_every_kind() -> None:
    """Every exact GGUF type as gate_up and down, a few tokens, top-2 of 5 (the ISA variants' check)."""
    for i, qtype in enumerate(sorted(EXACT_TYPES)):
        w13, w2 = expert_weights(qtype, 5, 2 * 256, 256, i), expert_weights(qtype, 5, 256, 256, i + 50)
        x = torch.randn(6, 256)
        ids, weights = routing(6, 5, 2, i)
        torch.testing.assert_close(run_kernel(x, ids, weights, w13, w2), reference(x, ids, weights, w13, w2),
                                   atol=1e-5, rtol=1e-4)


@needs_kernels
def test_every_gguf_block_type() -> None:
    check_every_kind()


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), tokens=st.integers(1, 40), experts=st.integers(1, 9),
       k=st.integers(1, 4), hidden_blocks=st.integers(1, 4), inter_blocks=st.integers(1, 3), act=st.sampled_from([0, 1]),
       skew=st.booleans(), seed=st.integers(0, 10_000))
def test_random_routings_and_shapes(kind, tokens, experts, k, hidden_blocks, inter_blocks, act, skew, seed) -> None:
    k = min(k, experts)
    hidden, inter = 32 * hidden_blocks, 32 * inter_blocks
    # a GGUF type whose blocks land in that kind (Q8_M: Q5_K's values held in 8 bits; Q8_16: Q6_K's)
    src = kind if kind in (0, 1) else {2: "Q5_K", 3: "Q6_K", 4: "Q2_K", 5: "Q5_1", 6: "Q6_K"}[kind]
    if src in ("Q5_K", "Q6_K", "Q2_K"):
        hidden, inter = 256 * hidden_blocks, 256 * inter_blocks  # K-quants are 256-wide
    w13 = expert_weights(src, experts, 2 * inter, hidden, seed, kind)
    w2 = expert_weights(src, experts, hidden, inter, seed + 1, kind)
    assert w13.kind == kind
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    ids, weights = routing(tokens, experts, k, seed, hot=0 if skew else None)
    torch.testing.assert_close(run_kernel(x, ids, weights, w13, w2, act), reference(x, ids, weights, w13, w2, act),
                               atol=1e-5, rtol=1e-4)


@needs_kernels
def test_a_tokens_result_does_not_depend_on_the_batch() -> None:
    """Bit for bit: a token alone, and among 37 others that load its experts with more rows."""
    w13, w2 = expert_weights("Q4_K", 8, 2 * 256, 256, 1), expert_weights("Q6_K", 8, 256, 256, 2)
    assert w13.d.dtype == w2.d.dtype == torch.uint8  # the K-quants' factored scales, as a file's load them
    x = torch.randn(38, 256)
    ids, weights = routing(38, 8, 3, 5, hot=2)
    batched = run_kernel(x, ids, weights, w13, w2)
    for t in (0, 17, 37):
        alone = run_kernel(x[t : t + 1].contiguous(), ids[t : t + 1].contiguous(), weights[t : t + 1].contiguous(),
                           w13, w2)
        assert torch.equal(alone[0], batched[t])


@needs_kernels
def test_expert_parallel_ranks_sum_to_the_whole_layer() -> None:
    """Two ranks holding experts 0-3 and 4-7 (expert_offset 0 and 4): each skips the other's pairs, and
    their outputs add up to the one-rank layer; a rank none of whose experts was chosen returns zeros."""
    w13, w2 = expert_weights(1, 8, 2 * 64, 96, 3), expert_weights(1, 8, 96, 64, 4)
    x = torch.randn(11, 96)
    ids, weights = routing(11, 8, 2, 9)
    whole = run_kernel(x, ids, weights, w13, w2)
    halves = []
    for r in range(2):
        part13 = ExpertQuantWeight(w13.kind, w13.n, w13.k, w13.data[4 * r : 4 * r + 4].contiguous(),
                                   w13.d[4 * r : 4 * r + 4].contiguous(), w13.m[4 * r : 4 * r + 4].contiguous())
        part2 = ExpertQuantWeight(w2.kind, w2.n, w2.k, w2.data[4 * r : 4 * r + 4].contiguous(),
                                  w2.d[4 * r : 4 * r + 4].contiguous(), w2.m[4 * r : 4 * r + 4].contiguous())
        halves.append(run_kernel(x, ids, weights, part13, part2, offset=4 * r))
        torch.testing.assert_close(halves[-1], reference(x, ids, weights, part13, part2, offset=4 * r),
                                   atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-5, rtol=1e-5)
    cold = torch.zeros_like(ids)  # every pair to expert 0: rank 1 holds none of them
    assert torch.equal(run_kernel(x, cold, weights, part13, part2, offset=4), torch.zeros_like(x))


@needs_kernels
def test_no_tokens() -> None:
    w13, w2 = expert_weights(0, 2, 64, 32, 0), expert_weights(0, 2, 32, 32, 1)
    out = run_kernel(torch.empty(0, 32), torch.empty(0, 1, dtype=torch.int64), torch.empty(0, 1), w13, w2)
    assert out.shape == (0, 32)


@needs_kernels
def test_bad_arguments_are_refused() -> None:
    w13, w2 = expert_weights(1, 3, 64, 32, 0), expert_weights(1, 3, 32, 32, 1)
    x, ids, weights = torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="act must be"):
        run_kernel(x, ids, weights, w13, w2, act=7)
    with pytest.raises(RuntimeError, match="topk_ids must be int64"):
        run_kernel(x, ids.int(), weights, w13, w2)
    with pytest.raises(RuntimeError, match="topk_weights must be float32 shaped like topk_ids"):
        run_kernel(x, ids, torch.ones(2, 2), w13, w2)
    with pytest.raises(RuntimeError, match="gate_up"):  # hidden 64 against weights made for 32
        run_kernel(torch.randn(2, 64), ids, weights, w13, w2)
    fewer = ExpertQuantWeight(w2.kind, w2.n, w2.k, w2.data[:2].contiguous(), w2.d[:2].contiguous(),
                              w2.m[:2].contiguous())
    with pytest.raises(RuntimeError, match="3 gate_up experts but 2 down experts"):
        run_kernel(x, ids, weights, w13, fewer)
    with pytest.raises(RuntimeError, match="needs its mins"):
        ops.fused_experts(x, ids, weights, 0, w13.kind, w13.n, w13.data, w13.d, None, w2.kind, w2.data, w2.d, w2.m,
                          0, torch.empty_like(x))
