"""DenseCache (lora/lora_dense.py): where lora_sgmv runs, the few-row layout keeps the adapters it holds and
grows by a step's new ones (a step with a subset reuses it: no rebuild, no rebinding of the decode stack), up to
its limit; its weights are in the kernel's dtype; the masked GEMM fallback lays out exactly the step's set. A
step's rows get their adapter's group in whichever layout, so the deltas equal the segmented path's."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.lora.lora_adapter import LoRAAdapter, stack_shards
from radixserve.lora.lora_batch import LoRABatch, torch_lora_apply
from radixserve.lora.lora_config import LoRAConfig
from radixserve.lora.lora_dense import DenseCache

ops, why = load_cpu_ops()
IN, SHARDS = 24, [16, 8, 8]  # a small qkv


def _adapter(uid: int, rank: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(uid)
    starts = [sum(SHARDS[:k]) for k in range(len(SHARDS))]
    # bf16-representable values (and a power-of-two scaling): a bf16 layout holds them exactly
    r16 = lambda t: t.bfloat16().float()  # noqa: E731
    pieces = [(o0, r16(torch.randn(rank, IN, generator=g)), r16(torch.randn(n, rank, generator=g)))
              for o0, n in zip(starts, SHARDS)]
    w = stack_shards(pieces, sum(SHARDS), 0.5, torch.float32, torch.device("cpu"))
    return LoRAAdapter(LoRAConfig(f"a{uid}", "", rank, 2.0 * rank, False, None), uid, {"qkv": w})


def _deltas(batch: LoRABatch, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(SHARDS))
    batch.dense.apply("qkv", x, out, None)
    return out


def _segmented(adapters: list[LoRAAdapter | None], x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(SHARDS))
    for i, a in enumerate(adapters):
        if a is not None:
            torch_lora_apply(x, slice(i, i + 1), a.weights["qkv"], out)
    return out


@pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_layout_grows_and_a_subset_reuses_it(dtype: torch.dtype) -> None:
    a = [_adapter(uid, rank) for uid, rank in ((1, 4), (2, 8), (3, 2), (4, 5))]
    cache = DenseCache(torch.float32, ops, dtype, limit=3)
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(9))

    def step(rows: list[LoRAAdapter | None]) -> LoRABatch:
        batch = LoRABatch.build(rows, [1] * len(rows), torch.device("cpu"), torch_lora_apply, cache)
        want = _segmented(rows, x[: len(rows)])
        got = _deltas(batch, x[: len(rows)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return batch

    b1 = step([a[0], a[1], None, a[1]])
    assert cache.key == (1, 2) and b1.dense.weights["qkv"].A.dtype == dtype
    w12 = cache.weights
    b2 = step([a[1], None])  # a subset: the same layout, adapter 2 keeps its group
    assert cache.weights is w12 and b2.dense.row_group.tolist() == [1, -1]
    step([a[2], a[0]])  # a new adapter joins the layout
    assert cache.key == (1, 2, 3) and cache.weights is not w12
    w123 = cache.weights
    step([a[0], a[2], a[1]])
    assert cache.weights is w123
    step([a[3], a[0]])  # past the limit of 3: the step's own set only
    assert cache.key == (1, 4)
    cache.forget(2)  # not held: the layout stays
    assert cache.key == (1, 4)
    cache.forget(4)  # held: the layout goes with it
    assert cache.key is None and cache.weights == {}
    step([a[0]])
    cache.drop()
    assert cache.key is None and cache.weights == {}


def test_the_masked_fallback_lays_out_exactly_the_steps_set() -> None:
    a = [_adapter(uid, 4) for uid in (1, 2, 3)]
    cache = DenseCache(torch.float32, None, torch.bfloat16)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(5))
    for rows in ([a[0], a[1], None], [a[1], None], [a[2], a[0], a[1]]):
        batch = LoRABatch.build(rows, [1] * len(rows), torch.device("cpu"), torch_lora_apply, cache)
        assert cache.key == tuple(sorted(r.uid for r in rows if r is not None))
        assert batch.dense.weights["qkv"].A.dtype == torch.float32  # the activations' dtype
        torch.testing.assert_close(_deltas(batch, x[: len(rows)]), _segmented(rows, x[: len(rows)]),
                                   rtol=1e-5, atol=1e-5)
