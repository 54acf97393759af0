"""lora_sgmv (kernels/cpu/csrc/lora_sgmv.cpp): each row's own adapter delta on one projection equals the
masked side-by-side GEMM pair (lora_dense.py's fallback) on random adapters of different ranks with stacked
(block-diagonal) B; a row's delta is the same alone and batched (bit for bit); base rows get nothing; a block
table outside the weights is refused."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")

SHARDS = [(0, 40), (40, 12), (52, 12)]  # a small qkv: q rows, k rows, v rows
IN = 37  # not a multiple of the kernel's 8 / 16 lanes


def _adapters(ranks: list[int], seed: int = 0):
    """A, B (block diagonal over SHARDS), Bt, blocks and col_group of adapters side by side."""
    g = torch.Generator().manual_seed(seed)
    out_f = sum(n for _, n in SHARDS)
    A = torch.randn(sum(3 * r for r in ranks), IN, generator=g)
    B = torch.zeros(out_f, A.shape[0])
    blocks, col = [], 0
    for a, r in enumerate(ranks):
        for o0, on in SHARDS:
            B[o0 : o0 + on, col : col + r] = torch.randn(on, r, generator=g)
            blocks.append([a, o0, on, col, r])
            col += r
    col_group = torch.cat([torch.full((3 * r,), a) for a, r in enumerate(ranks)])
    return A, B, B.t().contiguous(), torch.tensor(blocks), col_group


# row patterns: adapters with 4 and 5 rows, then 1, 2, 3, 6 and 7 (the kernel works in tiles of up to 4 rows)
ROWS = [[0, 1, 2, 3, -1] * 4 + [2], [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, -1, 0, 1, 2, 3, 3, 3, 2, 2, 2, 2]]


@pytest.mark.parametrize("pattern", ROWS)
def test_equals_the_masked_gemm_pair_and_is_batch_invariant(pattern: list[int]) -> None:
    A, B, Bt, blocks, col_group = _adapters([5, 16, 3, 9])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(pattern), IN, generator=g)
    rows = torch.tensor(pattern)
    base = torch.randn(len(pattern), B.shape[0], generator=g)
    out = base.clone()
    ops.lora_sgmv(x, rows, A, Bt, blocks, out)
    mask = (rows[:, None] == col_group[None, :]).float()
    want = base + ((x @ A.t()) * mask) @ B.t()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[rows == -1], base[rows == -1])  # base rows: untouched
    for i in range(len(pattern)):
        alone = base[i : i + 1].clone()
        ops.lora_sgmv(x[i : i + 1].clone(), rows[i : i + 1].clone(), A, Bt, blocks, alone)
        assert torch.equal(alone[0], out[i]), i


@pytest.mark.parametrize("pattern", ROWS)
def test_bf16_weights_compute_their_float32_copys_bits(pattern: list[int]) -> None:
    """bf16 A / Bt (the adapters as the fast mode holds them) widen exactly: the deltas are those of a float32
    copy of the same weights, bit for bit, and still the same alone and batched."""
    A, _, Bt, blocks, _ = _adapters([5, 16, 3, 9], seed=2)
    A16, Bt16 = A.bfloat16(), Bt.bfloat16()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(pattern), IN, generator=g)
    rows = torch.tensor(pattern)
    base = torch.randn(len(pattern), Bt.shape[1], generator=g)
    out16, out32 = base.clone(), base.clone()
    ops.lora_sgmv(x, rows, A16, Bt16, blocks, out16)
    ops.lora_sgmv(x, rows, A16.float(), Bt16.float(), blocks, out32)
    assert torch.equal(out16, out32)
    for i in range(len(pattern)):
        alone = base[i : i + 1].clone()
        ops.lora_sgmv(x[i : i + 1].clone(), rows[i : i + 1].clone(), A16, Bt16, blocks, alone)
        assert torch.equal(alone[0], out16[i]), i


def test_bad_block_tables_and_shapes_are_refused() -> None:
    A, _, Bt, blocks, _ = _adapters([4])
    x, out, rows = torch.randn(2, IN), torch.zeros(2, Bt.shape[1]), torch.tensor([0, 0])
    with pytest.raises(RuntimeError, match="lies outside"):
        ops.lora_sgmv(x, rows, A, Bt, torch.tensor([[0, 60, 10, 0, 4]]), out)
    with pytest.raises(RuntimeError, match="Bt must be"):
        ops.lora_sgmv(x, rows, A, Bt.t().contiguous(), blocks, out)
    with pytest.raises(RuntimeError, match="row_group"):
        ops.lora_sgmv(x, torch.tensor([0]), A, Bt, blocks, out)
    with pytest.raises(RuntimeError, match="in A's dtype"):  # bf16 A with a float32 Bt
        ops.lora_sgmv(x, rows, A.bfloat16(), Bt, blocks, out)
    with pytest.raises(RuntimeError, match="A must be float32 or bfloat16"):
        ops.lora_sgmv(x, rows, A.half(), Bt.half(), blocks, out)
