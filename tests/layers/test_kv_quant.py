"""--kv-cache-dtype int8 (llama.cpp's q8_0 blocks) and fp8_e4m3 (a float32 scale per head and token, e4m3 values):
mem_cache/kv_quant.py and kernels/cpu/csrc/kv_quant.h. The PyTorch writer's bits, ggml's reference quantiser and
the C++ writer's bits (the decode stack) agree; every attention kernel reading the rows in place (paged decode,
varlen, flash extend, with windows and soft-caps) matches a float64 reference over the dequantised KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.mem_cache.kv_quant import (
    KV_FP8,
    dequantize_kv,
    dequantize_q8,
    kv_bytes_per_value,
    kv_row_width,
    q8_row_bytes,
    quantize_fp8,
    quantize_kv,
    quantize_q8,
)
from radixserve.mem_cache.memory_pool import KVPool

ops, why = load_cpu_ops()
needs_ops = pytest.mark.skipif(ops is None, reason=f"C++ kernels could not be built here: {why}")


def test_blocks_are_ggmls_q8_0_bits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 2, 64)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0, values 0
    x[1, 1, 5] = 0.5 * (x[1, 1].abs().max() / 127)  # ties round away from zero, as ggml's roundf
    ours = quantize_q8(x)
    assert ours.shape == (7, 3, 68) and ours.dtype == torch.int8
    ref = gguf_quantize(x.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)  # [7, 3, 68] uint8
    assert np.array_equal(ours.numpy().view(np.uint8), ref)
    back = dequantize_q8(ours)
    assert (back - x).abs().max() <= x.abs().amax() / 254 * 1.01
    assert kv_bytes_per_value(torch.int8) == 34 / 32 and q8_row_bytes(128) == 136
    with pytest.raises(ValueError, match="kv_cache_dtype int8.*multiple of 32"):
        q8_row_bytes(80)


def test_pool_stores_blocks_and_sizes_by_them() -> None:
    pool = KVPool(10, 2, 2, 64, torch.int8)
    assert pool.k_buffer[0].shape == (10, 2, 68) and pool.row_width == 68
    assert KVPool.bytes_per_token(2, 2, 64, torch.int8) == 2 * 2 * 2 * 68
    k = torch.randn(3, 2, 64)
    pool.set_kv_buffer(1, torch.tensor([4, 7, 2]), k, k * 2)
    assert torch.equal(pool.k_buffer[1][torch.tensor([4, 7, 2])], quantize_q8(k))


def _dequant_pool(pool: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(pool, torch.float64)


def test_fp8_rows_hold_a_scale_per_head_and_token() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 64, generator=g) * torch.logspace(-2, 2, 64)
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    rows = quantize_fp8(x)
    assert rows.shape == (5, 2, 68) and rows.dtype == KV_FP8
    scale = rows[..., :4].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 448)
    back = dequantize_kv(rows, torch.float32)
    assert back[0, 0].abs().max() == 0
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 16 + 1e-12).all()  # e4m3: 3 mantissa bits
    assert kv_row_width(KV_FP8, 128) == 132 and kv_bytes_per_value(KV_FP8, 64) == 68 / 64
    for bad in (96, 4):
        with pytest.raises(ValueError, match="fp8_e4m3 needs a head_dim that is a power of two"):
            kv_row_width(KV_FP8, bad)


def _reference(q, k, v, kv_idx, seq_lens, q_start, q_lens, scale, window, cap):
    """float64 attention over the dequantised pool: query i of request b at position seq_len - q_len + i sees keys
    p - window < j <= p (window 0: all), scores soft-capped."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(kv_idx.shape[0]):
        s, n, st0 = int(seq_lens[b]), int(q_lens[b]), int(q_start[b])
        kb = k[kv_idx[b, :s]].repeat_interleave(group, 1).transpose(0, 1)  # [H, s, D]
        vb = v[kv_idx[b, :s]].repeat_interleave(group, 1).transpose(0, 1)
        qb = q[st0:st0 + n].double().transpose(0, 1)  # [H, n, D]
        sc = qb @ kb.transpose(1, 2) * scale
        if cap:
            sc = torch.tanh(sc / cap) * cap
        pos = s - n + torch.arange(n).unsqueeze(1)
        j = torch.arange(s).unsqueeze(0)
        vis = (j <= pos) & ((j > pos - window) if window else True)
        sc = sc.masked_fill(~vis, float("-inf"))
        out[st0:st0 + n] = (torch.softmax(sc, -1) @ vb).transpose(0, 1)
    return out


@needs_ops
@pytest.mark.parametrize("kv", [torch.int8, KV_FP8])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), lens=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 40)), min_size=1,
                                                    max_size=4),
       heads=st.sampled_from([(9, 3), (4, 4), (8, 1)]), D=st.sampled_from([32, 64, 128]),
       window=st.sampled_from([0, 7]), cap=st.sampled_from([0.0, 30.0]))
def test_kernels_read_the_rows_in_place(kv, seed, lens, heads, D, window, cap) -> None:
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    nb, max_len = len(lens), max(p + n for p, n in lens)
    S = nb * max_len + 5
    k8 = quantize_kv(torch.randn(S, Hkv, D, generator=g), kv)
    v8 = quantize_kv(torch.randn(S, Hkv, D, generator=g), kv)
    kv_idx = torch.randperm(S, generator=g)[: nb * max_len].view(nb, max_len).contiguous()
    q_lens = torch.tensor([n for _, n in lens])
    seq_lens = torch.tensor([p + n for p, n in lens])
    q_start = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), H, D, generator=g)
    scale = D**-0.5
    ref = _reference(q, _dequant_pool(k8), _dequant_pool(v8), kv_idx, seq_lens, q_start, q_lens, scale, window, cap)
    for op in (ops.extend_attention, ops.paged_attention_varlen):
        out = torch.zeros_like(q)
        op(q, k8, v8, kv_idx, seq_lens, q_start, q_lens, scale, window, cap, out)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    # the fixed-L decode kernel: every request's last query row alone
    last = q_start + q_lens - 1
    out = torch.zeros(nb, H, D)
    ops.paged_attention(q[last].contiguous(), k8, v8, kv_idx, seq_lens, 1, scale, window, cap, out)
    torch.testing.assert_close(out.double(), ref[last], atol=2e-5, rtol=1e-4)


@needs_ops
def test_kernels_refuse_a_mismatched_block_row() -> None:
    q = torch.randn(1, 2, 64)
    bad = torch.zeros(4, 1, 64, dtype=torch.int8)  # 64 bytes: not 2 blocks of 34
    with pytest.raises(RuntimeError, match="head layout"):
        ops.paged_attention(q, bad, bad, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([2]), 1, 0.1, 0, 0.0,
                            torch.empty_like(q))
