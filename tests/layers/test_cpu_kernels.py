"""radixserve's C++ CPU kernels against plain PyTorch: paged attention against
scaled_dot_product_attention over explicitly gathered KV, and the decoder-layer glue (fused
add + RMSNorm, RoPE, SiLU- and GELU-tanh-and-mul) against the modules' own PyTorch paths, and the greedy
sampler's argmax against torch.argmax.

Slots are scattered at random over a pool larger than the batch needs (as after eviction and
retraction), query blocks of length L > 1 check the causal limit inside the block (TARGET_VERIFY),
and head_dim 24 exercises the non-AVX tail path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.activation import GeluTanhAndMul, SiluAndMul
from radixserve.layers.cpu_kernel_layer import enable_cpu_kernels
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding

ops, why = load_cpu_ops()
kernel = ops.paged_attention if ops is not None else None
pytestmark = pytest.mark.skipif(ops is None, reason=f"C++ kernels could not be built here: {why}")


def reference(q, k_pool, v_pool, kv_idx, seq_lens, L, scale):
    nb, max_len = kv_idx.shape
    H, D = q.shape[1], q.shape[2]
    kb = k_pool[kv_idx].transpose(1, 2)  # [nb, Hkv, max_len, D]
    vb = v_pool[kv_idx].transpose(1, 2)
    q_pos = (seq_lens - L).unsqueeze(1) + torch.arange(L)  # [nb, L]
    mask = torch.arange(max_len).view(1, 1, max_len) <= q_pos.unsqueeze(-1)
    qb = q.view(nb, L, H, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(nb * L, H, D)


def make_case(seed, nb, L, H, Hkv, D, max_len, pool=None):
    g = torch.Generator().manual_seed(seed)
    S = pool or nb * max_len + 17
    k_pool = torch.randn(S, Hkv, D, generator=g)
    v_pool = torch.randn(S, Hkv, D, generator=g)
    seq_lens = torch.randint(L, max_len + 1, (nb,), generator=g)
    seq_lens[0] = max_len
    kv_idx = torch.randperm(S, generator=g)[: nb * max_len].view(nb, max_len).contiguous()
    q = torch.randn(nb * L, H, D, generator=g) * 2
    return q, k_pool, v_pool, kv_idx, seq_lens


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    nb=st.integers(1, 9),
    L=st.sampled_from([1, 1, 2, 5]),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 2), (6, 1)]),
    D=st.sampled_from([64, 16, 24]),
    max_len=st.integers(5, 300),
)
def test_kernel_matches_sdpa(seed, nb, L, heads, D, max_len):
    H, Hkv = heads
    q, k_pool, v_pool, kv_idx, seq_lens = make_case(seed, nb, L, H, Hkv, D, max(max_len, L))
    scale = D**-0.5
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, kv_idx, seq_lens, L, scale, 0, 0.0, out)
    ref = reference(q, k_pool, v_pool, kv_idx, seq_lens, L, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), nb=st.integers(1, 5), L=st.sampled_from([1, 3]), D=st.sampled_from([64, 24]),
       max_len=st.integers(4, 200))
def test_bf16_kv_is_the_float_kernel_on_the_widened_pool(seed, nb, L, D, max_len):
    """--kv-cache-dtype bfloat16: the kernels widen each K/V element on load, which is exact, so the
    result is bit for bit the float32 kernel's on the bf16-rounded pool (both kernels: fixed-L and varlen)."""
    q, k_pool, v_pool, kv_idx, seq_lens = make_case(seed, nb, L, 9, 3, D, max(max_len, L))
    kb, vb = k_pool.bfloat16(), v_pool.bfloat16()
    got, want = torch.empty_like(q), torch.empty_like(q)
    kernel(q, kb, vb, kv_idx, seq_lens, L, D**-0.5, 0, 0.0, got)
    kernel(q, kb.float(), vb.float(), kv_idx, seq_lens, L, D**-0.5, 0, 0.0, want)
    assert torch.equal(got, want)
    starts, lens = torch.arange(nb) * L, torch.full((nb,), L)
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    ops.paged_attention_varlen(q, kb, vb, kv_idx, seq_lens, starts, lens, D**-0.5, 0, 0.0, got)
    ops.paged_attention_varlen(q, kb.float(), vb.float(), kv_idx, seq_lens, starts, lens, D**-0.5, 0, 0.0, want)
    assert torch.equal(got, want)


def varlen_reference(q, k_pool, v_pool, kv_idx, seq_lens, q_start, q_lens, scale):
    """SDPA per request over its gathered history, query i at position seq_len - q_len + i."""
    out = torch.zeros_like(q)
    for b in range(kv_idx.shape[0]):
        s, n, st = int(seq_lens[b]), int(q_lens[b]), int(q_start[b])
        if n == 0:
            continue
        kb = k_pool[kv_idx[b, :s]].float().transpose(0, 1).unsqueeze(0)
        vb = v_pool[kv_idx[b, :s]].float().transpose(0, 1).unsqueeze(0)
        mask = torch.arange(s).unsqueeze(0) <= (s - n + torch.arange(n)).unsqueeze(1)
        qb = q[st : st + n].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[st : st + n] = o.squeeze(0).transpose(0, 1)
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), lens=st.lists(st.tuples(st.integers(0, 150), st.integers(1, 130)), min_size=1,
                                                    max_size=4),
       heads=st.sampled_from([(9, 3), (4, 4), (8, 2)]), D=st.sampled_from([64, 16, 24]),
       bf16=st.booleans())
def test_extend_attention_matches_sdpa(seed, lens, heads, D, bf16):
    """The flash kernel for long query blocks: (prefix, new) lengths per request, scattered slots, GQA,
    head dims off the vector tile, KV in float32 or bf16."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    nb, max_len = len(lens), max(p + n for p, n in lens)
    S = nb * max_len + 9
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    if bf16:
        k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    kv_idx = torch.randperm(S, generator=g)[: nb * max_len].view(nb, max_len).contiguous()
    q_lens = torch.tensor([n for _, n in lens])
    seq_lens = torch.tensor([p + n for p, n in lens])
    q_start = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), H, D, generator=g) * 2
    out = torch.empty_like(q)
    ops.extend_attention(q, k_pool, v_pool, kv_idx, seq_lens, q_start, q_lens, D**-0.5, 0, 0.0, out)
    ref = varlen_reference(q, k_pool, v_pool, kv_idx, seq_lens, q_start, q_lens, D**-0.5)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), lens=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 90)), min_size=1,
                                                    max_size=3),
       window=st.sampled_from([0, 7, 40]), spans=st.data())
def test_extend_attention_with_image_spans_matches_a_masked_sdpa(seed, lens, window, spans):
    """q_last (Gemma 3's image spans, seen both ways): row i sees keys up to q_last[i] (not only its position),
    the last `window` before its position on a local layer: SDPA with that mask, over the gathered history."""
    H, Hkv, D = 4, 2, 16
    g = torch.Generator().manual_seed(seed)
    nb, max_len = len(lens), max(p + n for p, n in lens)
    S = nb * max_len + 3
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    kv_idx = torch.randperm(S, generator=g)[: nb * max_len].view(nb, max_len).contiguous()
    q_lens = torch.tensor([n for _, n in lens])
    seq_lens = torch.tensor([p + n for p, n in lens])
    q_start = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), H, D, generator=g) * 2
    last = []
    for p, n in lens:  # one span inside each request's new rows (or none): its rows see to its end
        pos = list(range(p, p + n))
        a = spans.draw(st.integers(0, n - 1))
        b = spans.draw(st.integers(a + 1, n))
        last += [p + b - 1 if a <= i < b else p + i for i in range(n)]
    q_last = torch.tensor(last)
    out = torch.empty_like(q)
    ops.extend_attention(q, k_pool, v_pool, kv_idx, seq_lens, q_start, q_lens, D**-0.5, window, 0.0, out, q_last)
    ref = torch.zeros_like(q)
    for b, (p, n) in enumerate(lens):
        s0 = int(q_start[b])
        kb = k_pool[kv_idx[b, : p + n]].transpose(0, 1).unsqueeze(0)
        vb = v_pool[kv_idx[b, : p + n]].transpose(0, 1).unsqueeze(0)
        key, qp = torch.arange(p + n).unsqueeze(0), (p + torch.arange(n)).unsqueeze(1)
        mask = key <= q_last[s0 : s0 + n].unsqueeze(1)
        if window:
            mask &= key > qp - window
        o = F.scaled_dot_product_attention(q[s0 : s0 + n].transpose(0, 1).unsqueeze(0), kb, vb, attn_mask=mask,
                                           scale=D**-0.5, enable_gqa=True)
        ref[s0 : s0 + n] = o.squeeze(0).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)
    bad = q_last.clone()
    bad[0] = int(seq_lens[0])  # past the request's keys
    with pytest.raises(RuntimeError, match="q_last"):
        ops.extend_attention(q, k_pool, v_pool, kv_idx, seq_lens, q_start, q_lens, D**-0.5, window, 0.0, out, bad)


@pytest.mark.parametrize("op", ["extend_attention", "paged_attention_varlen"])
def test_varlen_ops_refuse_bad_tables_naming_themselves(op):
    """Both variable-length ops share one argument rule (check_varlen_attention); each names itself."""
    q, k_pool = torch.randn(4, 4, 16), torch.randn(8, 2, 16)
    ok = {"kv_idx": torch.arange(8).view(1, 8), "seq_lens": torch.tensor([6]), "q_start": torch.tensor([0]),
          "q_lens": torch.tensor([4])}
    for field, value, message in (("kv_idx", torch.full((1, 8), 10**6), "outside the pool of 8"),
                                  ("q_start", torch.tensor([3]), "outside q's 4 rows"),
                                  ("seq_lens", torch.tensor([9]), "seq_len 9 of request 0 outside"),
                                  ("q_lens", torch.tensor([4, 1]), "one entry per kv_idx row")):
        a = {**ok, field: value}
        with pytest.raises(RuntimeError, match=f"{op}: .*{message}"):
            getattr(ops, op)(q, k_pool, k_pool.clone(), a["kv_idx"], a["seq_lens"], a["q_start"], a["q_lens"],
                             0.25, 0, 0.0, torch.empty_like(q))


def test_rows_beyond_seq_len_are_never_read():
    """Slot-table entries past a request's seq_len may be garbage (freed slots): they must not matter."""
    q, k_pool, v_pool, kv_idx, seq_lens = make_case(3, 4, 1, 9, 3, 64, 40)
    seq_lens = torch.tensor([40, 7, 1, 23])
    out1 = torch.empty_like(q)
    kernel(q, k_pool, v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, out1)
    for b in range(4):
        kv_idx[b, seq_lens[b]:] = 10**9  # would crash if read
    out2 = torch.empty_like(q)
    kernel(q, k_pool, v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, out2)
    assert torch.equal(out1, out2)


def test_each_request_is_independent_of_its_batch():
    """Batch invariance: a request's output is bit-identical alone and inside a batch."""
    q, k_pool, v_pool, kv_idx, seq_lens = make_case(5, 6, 1, 9, 3, 64, 120)
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, out)
    for b in range(6):
        alone = torch.empty_like(q[b : b + 1])
        kernel(q[b : b + 1].contiguous(), k_pool, v_pool, kv_idx[b : b + 1].contiguous(), seq_lens[b : b + 1], 1,
               0.125, 0, 0.0, alone)
        assert torch.equal(alone, out[b : b + 1])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c[3].__setitem__((0, 0), 10**6), "outside the pool"),
        (lambda c: c[3].__setitem__((0, 0), -1), "outside the pool"),
        (lambda c: c[4].__setitem__(0, 10**4), "seq_len"),
        (lambda c: c[4].__setitem__(0, 0), "seq_len"),
    ],
)
def test_bad_tables_raise_instead_of_reading_out_of_bounds(mutate, message):
    case = list(make_case(7, 2, 1, 9, 3, 64, 16))
    mutate(case)
    q, k_pool, v_pool, kv_idx, seq_lens = case
    with pytest.raises(RuntimeError, match=message):
        kernel(q, k_pool, v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, torch.empty_like(q))


def test_wrong_dtype_and_shape_raise():
    q, k_pool, v_pool, kv_idx, seq_lens = make_case(8, 2, 1, 9, 3, 64, 16)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), k_pool, v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, torch.empty_like(q).double())
    with pytest.raises(RuntimeError, match="k and v both float32, bfloat16, int8 \\(q8_0\\) or fp8"):
        kernel(q, k_pool.bfloat16(), v_pool, kv_idx, seq_lens, 1, 0.125, 0, 0.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="k and v both float32, bfloat16, int8 \\(q8_0\\) or fp8"):
        kernel(q, k_pool.half(), v_pool.half(), kv_idx, seq_lens, 1, 0.125, 0, 0.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_pool, v_pool, kv_idx.int(), seq_lens, 1, 0.125, 0, 0.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="nb \\* L"):
        kernel(q, k_pool, v_pool, kv_idx, seq_lens, 2, 0.125, 0, 0.0, torch.empty_like(q))


def _with_ops(module, enabled: bool):
    module.cpu_ops = ops if enabled else None
    return module


@pytest.mark.parametrize("n", [1, 3, 40])
def test_rms_norm_with_and_without_residual(n):
    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    x = torch.randn(n, 576, generator=g) * 3
    res = torch.randn(n, 576, generator=g)
    ref = _with_ops(norm, False)(x.clone())
    ref_out, ref_res = norm(x.clone(), res.clone())
    fast = _with_ops(norm, True)
    x_in = x.clone()
    out = fast(x_in)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(x_in, x)  # without a residual the input is left alone (callers keep it)
    out2, res2 = fast(x.clone(), res.clone())
    torch.testing.assert_close(out2, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res2, ref_res, atol=1e-6, rtol=1e-6)


def test_rope_in_place_on_a_strided_qkv_view():
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 4096, 10000.0)
    n, hq, hk = 7, 9, 3
    qkv = torch.randn(n, (hq + 2 * hk) * 64, generator=g)
    positions = torch.tensor([0, 1, 5, 100, 4000, 17, 2])
    qk_ref = _with_ops(rope, False).rotate_heads(positions, qkv[:, : (hq + hk) * 64].reshape(n, -1, 64))
    v_before = qkv[:, (hq + hk) * 64 :].clone()
    view = qkv[:, : (hq + hk) * 64].view(n, -1, 64)  # rows strided by the whole qkv width
    out = _with_ops(rope, True).rotate_heads(positions, view)
    assert out.data_ptr() == view.data_ptr()  # rotated in place
    torch.testing.assert_close(out, qk_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (hq + hk) * 64 :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_(view, torch.tensor([0, 1, 2, 3, 4, 5, 4096]), rope.cos_cache, rope.sin_cache)


def test_enable_cpu_kernels_sets_the_declared_layers_only():
    class Stranger(torch.nn.Module):  # an attribute of the same name is not a declaration
        cpu_ops = None

    model = torch.nn.Sequential(RMSNorm(8), SiluAndMul(), GeluTanhAndMul(), RotaryEmbedding(8, 16, 1e4), Stranger())
    assert enable_cpu_kernels(model, ops) == 4
    assert all(m.cpu_ops is ops for m in model[:4]) and model[4].cpu_ops is None
    assert enable_cpu_kernels(model, None) == 4 and all(m.cpu_ops is None for m in model)


def test_rope_rows_are_the_steps_own_never_a_stale_buffers():
    """cos / sin rows are cached per step (ForwardBatch.rope_rows), not on the module: a positions buffer
    refilled in place for the next step gets fresh rows, while the layers of one step share one gather."""
    rope = _with_ops(RotaryEmbedding(64, 4096, 10000.0, rotary_dim=32), False)  # partial: the cos_sin path
    positions = torch.tensor([3, 9, 27])
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3))
    step1: dict = {}
    first = rope.rotate_heads(positions, x, step1)
    cos1, _ = rope.cos_sin(positions, step1)
    assert rope.cos_sin(positions, step1)[0] is cos1  # a second layer of the step reuses the gather
    positions[:] = torch.tensor([100, 200, 300])  # the same tensor, refilled by the next step
    step2: dict = {}
    second = rope.rotate_heads(positions, x, step2)
    fresh = RotaryEmbedding(64, 4096, 10000.0, rotary_dim=32).rotate_heads(positions.clone(), x)
    torch.testing.assert_close(second, fresh, atol=0, rtol=0)
    assert not torch.equal(first, second)
    assert torch.equal(rope.cos_sin(positions, step2)[0], rope.cos_cache[positions].unsqueeze(1))


@pytest.mark.parametrize("n", [1, 33])
def test_silu_and_mul(n):
    x = torch.randn(n, 2 * 1536, generator=torch.Generator().manual_seed(n)) * 4
    act = SiluAndMul()
    ref = _with_ops(act, False)(x)
    torch.testing.assert_close(_with_ops(act, True)(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 33])
def test_gelu_tanh_and_mul(n):
    """Gemma's gated activation; I = 1000 leaves a tail after the vector loop."""
    x = torch.randn(n, 2 * 1000, generator=torch.Generator().manual_seed(n)) * 4
    act = GeluTanhAndMul()
    ref = _with_ops(act, False)(x)
    torch.testing.assert_close(_with_ops(act, True)(x), ref, atol=1e-5, rtol=1e-5)
    out = torch.empty(n, 999)
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul"):
        ops.gelu_tanh_and_mul(x, out)


def test_rms_norm_of_a_strided_view_takes_the_kernel():
    """QK-norm with one KV head norms k as a strided view of the qkv output: it gets the floats of its
    contiguous copy, at every row count (a one-row view is contiguous), as the decode stack computes."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3 * 256, generator=g)
    norm = _with_ops(RMSNorm(256, eps=1e-6), True)
    norm.weight.data.normal_(1.0, 0.3, generator=g)
    k = qkv[:, 256:512]
    assert not k.is_contiguous()
    out = norm(k)
    assert torch.equal(out, norm(k.contiguous()))
    assert all(torch.equal(out[i : i + 1], norm(k[i : i + 1])) for i in range(6))


NAN, INF = float("nan"), float("inf")
# rows torch.argmax settles by its rules: the first of tied maxima, -0.0 equal to +0.0, inf, the first NaN
ARGMAX_CASES = [
    torch.tensor([[1.0, 3.0, 3.0, 2.0], [-0.0, 0.0, -1.0, -0.0], [-INF, -INF, -INF, -INF], [2.0, INF, 5.0, INF],
                  [1.0, NAN, 9.0, NAN], [-INF, -1e-45, -3e38, -2.0], [0.0, -0.0, 0.0, 1e-45]]),
    torch.tensor([[NAN]]),
    torch.full((3, 37), -7.5),
]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.data())
def test_greedy_argmax_equals_torch_argmax(rows: int, vocab: int, data) -> None:
    """Random rows drawn from a few values (so ties are common), with some specials; a view of wider rows too
    (the logits of a padded vocabulary), and a single-thread run equal to the threaded one."""
    pool = data.draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 3.25, INF, -INF, NAN, 1e-45, 3e38]),
                              min_size=1, max_size=4))
    values = data.draw(st.lists(st.sampled_from(pool) | st.floats(-1e3, 1e3, width=32), min_size=rows * vocab,
                                max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    assert torch.equal(ops.greedy_argmax(logits), torch.argmax(logits, dim=-1))
    wide = torch.cat([logits, torch.full((rows, 3), INF)], dim=1)[:, :vocab]  # rows with a stride
    assert torch.equal(ops.greedy_argmax(wide), torch.argmax(wide, dim=-1))


@pytest.mark.parametrize("case", ARGMAX_CASES)
def test_greedy_argmax_edge_rows(case: torch.Tensor) -> None:
    assert torch.equal(ops.greedy_argmax(case), torch.argmax(case, dim=-1))


def test_greedy_argmax_refuses_what_it_cannot_read() -> None:
    for bad in (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3), torch.zeros(2, 0), torch.zeros(3, 2).t()):
        with pytest.raises(RuntimeError, match="greedy_argmax"):
            ops.greedy_argmax(bad)


def test_the_sampler_takes_the_kernel_and_falls_back_where_it_cannot() -> None:
    from radixserve.layers.sampler import Sampler

    sampler = Sampler(cpu_ops=ops)
    logits = torch.randn(4, 1000)
    assert sampler.cpu_ops is ops
    assert torch.equal(sampler.argmax(logits), torch.argmax(logits, dim=-1))
    for other in (logits.double(), logits.bfloat16(), logits.t().contiguous().t()):  # torch.argmax for these
        assert torch.equal(sampler.argmax(other), torch.argmax(other, dim=-1))
    assert Sampler().cpu_ops is None
