"""The paged attention kernel takes the G query heads that share a kv head together (each V row read once for
all of them), in register-sized chunks of columns whose width depends on how many heads a chunk holds and on
the ISA (paged_attention.cpp, rows_weighted_sum: three heads take 16 columns a pass on AVX2, others 32). The
width must never change a bit: a query head's output beside its G - 1 neighbours equals its output alone,
against a pool holding only its kv head. Head dims 32 and 96 run the weighted sums' passes 2 and 6 times for
three heads; at 64 the scores' 4-key tiles serve every G (7 = a chunk of 4 and one of 3).

Out of scope, and so not asserted: the scores of 4+ heads off head dim 64, and of 2+ heads at 128, take a
scalar or two-chunk path whose last bits depend on the chunk's size (as before this width existed). A model's
G is fixed, so a request's tokens never depend on it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"C++ kernels could not be built here: {why}")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), GD=st.one_of(st.tuples(st.integers(1, 3), st.sampled_from([32, 96])),
                                                st.tuples(st.integers(1, 7), st.just(64))),
       Hkv=st.integers(1, 3), L=st.sampled_from([1, 1, 3]), length=st.integers(3, 200), bf16=st.booleans())
def test_a_heads_output_does_not_depend_on_its_group(seed, GD, Hkv, L, length, bf16):
    G, D = GD
    g = torch.Generator().manual_seed(seed)
    S, nb = 2 * length + 11, 2
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    if bf16:
        k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    kv_idx = torch.randperm(S, generator=g)[: nb * length].view(nb, length).contiguous()
    seq_lens = torch.tensor([length, max(L, length - 2)])
    q = torch.randn(nb * L, Hkv * G, D, generator=g)
    out = torch.empty_like(q)
    ops.paged_attention(q, k_pool, v_pool, kv_idx, seq_lens, L, D**-0.5, 0, 0.0, out)
    for j in range(Hkv * G):
        h = j // G
        qj = q[:, j : j + 1].contiguous()
        alone = torch.empty_like(qj)
        ops.paged_attention(qj, k_pool[:, h : h + 1].contiguous(), v_pool[:, h : h + 1].contiguous(), kv_idx,
                            seq_lens, L, D**-0.5, 0, 0.0, alone)
        assert torch.equal(alone, out[:, j : j + 1]), f"query head {j} of {Hkv * G} (G={G})"
