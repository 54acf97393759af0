"""DenseLoRA: a few-row step (decode) with several adapters, in one pair of GEMMs per projection.

The segmented path (lora_batch.py) costs a gather, two GEMMs and a scatter per adapter per projection: on
a decode step of 32 rows over 8 adapters that is ~4 x 8 small ops per projection, and the per-op overhead
dominates. Here the step's adapters are laid side by side once (cached while the same set of adapters
runs, which under steady load is most steps):

    A_cat = [A_0; A_1; ...]           [sum of ranks, in]
    B_cat = [B_0 | B_1 | ...]         [out, sum of ranks]
    col_group                         [sum of ranks]   which adapter each rank column belongs to

    t   = x @ A_cat.T                 [rows, sum of ranks]   every row against every adapter (rows are few)
    t  *= (row_group[:, None] == col_group[None, :])        a row keeps its own adapter's columns only
    out += t @ B_cat.T                                       base rows (group -1) add exact zeros

On the CPU with radixserve's kernels (and one rank: no all-reduce between A and B) the same side-by-side
weights go to `lora_sgmv` instead (kernels/cpu/csrc/lora_sgmv.cpp): each row against its own adapter's ranks
only, and only the non-zero blocks of a stacked projection's B (`blocks`), so no row pays for the other
adapters (the masked GEMMs above do 8x the work at 8 adapters). The native decode stack calls the same op.
The masked GEMM pair stays as the fallback (CUDA, tensor parallel, no C++ kernels).

The extra products are rows x (sum of ranks) x in flops, small next to the base GEMM for few rows; for
many rows (prefill) the segmented path runs instead (ROW_LIMIT).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.lora.lora_adapter import LoRAAdapter

ROW_LIMIT = 64  # steps with more token rows use the segmented path


@dataclass
class DenseWeights:
    A: torch.Tensor  # [sum of ranks, in]
    B: torch.Tensor  # [out, sum of ranks]
    col_group: torch.Tensor  # [sum of ranks] int64: index of the adapter (in the set) owning each column
    reduce: bool  # row-parallel under TP: all-reduce t before B (lora_adapter.LoRAWeights.reduce)
    blocks: torch.Tensor  # [S, 5] int64 (adapter, out start, out rows, rank start, ranks): B's non-zero blocks
    Bt: torch.Tensor | None = None  # [sum of ranks, out]: B transposed, what lora_sgmv reads (DenseCache.ops)


def concat_adapters(adapters: list[LoRAAdapter], dtype: torch.dtype, transposed: bool = False) -> dict[str, DenseWeights]:
    """Module -> the side-by-side weights of `adapters` (in this order: group g = adapters[g]), in `dtype`."""
    out: dict[str, DenseWeights] = {}
    names = sorted({n for a in adapters for n in a.weights})
    for name in names:
        parts = [(g, a.weights[name]) for g, a in enumerate(adapters) if name in a.weights]
        A = torch.cat([w.A for _, w in parts], dim=0).to(dtype).contiguous()
        B = torch.cat([w.B for _, w in parts], dim=1).to(dtype).contiguous()
        cols = torch.cat([torch.full((w.A.shape[0],), g, dtype=torch.int64) for g, w in parts]).to(A.device)
        blocks, col = [], 0
        for g, w in parts:
            for o0, on, r0, rn in w.block_table().tolist():
                blocks.append([g, o0, on, col + r0, rn])
            col += w.A.shape[0]
        out[name] = DenseWeights(A, B, cols, parts[0][1].reduce, torch.tensor(blocks, dtype=torch.int64),
                                 B.t().contiguous() if transposed else None)
    return out


@dataclass
class DenseLoRA:
    weights: dict[str, DenseWeights]
    row_group: torch.Tensor  # [rows] int64: the adapter group of each token row, -1 = base
    ops: Any = None  # torch.ops.radixserve_cpu where lora_sgmv runs these rows (DenseCache.ops), else None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # id(col_group) -> [rows, sum of ranks]

    def mask(self, w: DenseWeights, dtype: torch.dtype) -> torch.Tensor:
        m = self._masks.get(id(w.col_group))
        if m is None:
            m = self._masks[id(w.col_group)] = (self.row_group[:, None] == w.col_group[None, :]).to(dtype)
        return m

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor, ps: Any) -> None:
        w = self.weights.get(name)
        if w is None:
            return
        if self.ops is not None and not w.reduce and out.dtype == torch.float32:
            self.ops.lora_sgmv(x.float().contiguous(), self.row_group, w.A, w.Bt, w.blocks, out)
            return
        t = x.to(w.A.dtype) @ w.A.t()  # [rows, sum of ranks]
        if w.reduce:
            t = ps.all_reduce(t)
        t.mul_(self.mask(w, t.dtype))
        if out.dtype == t.dtype:
            out.addmm_(t, w.B.t())
        else:
            out += (t @ w.B.t()).to(out.dtype)


class DenseCache:
    """The adapters of recent few-row steps laid side by side (lora_sgmv's layout, or the masked GEMMs').

    Where lora_sgmv runs the set, the layout keeps every adapter it has held (up to `limit`) and grows by the
    ones a step brings: the kernel touches only the adapters that have rows, so a superset costs a step
    nothing, while rebuilding it (and rebinding the native decode stack) whenever the step's set changes cost
    ~3.5 ms a step under a mixed load (a short prefill with one adapter between two decode steps with eight).
    It keeps the weights in the kernel's dtype (bf16 where the float GEMMs are bf16: half the bytes a decode
    step streams; the kernel widens each weight exactly). The masked GEMM fallback multiplies every row by
    every adapter, so it lays out exactly the step's set, in the activations' dtype."""

    def __init__(self, dtype: torch.dtype = torch.float32, ops: Any = None,
                 weight_dtype: torch.dtype | None = None, limit: int = 64) -> None:
        self.key: tuple[int, ...] | None = None  # the uids laid out, in group order
        self.weights: dict[str, DenseWeights] = {}
        self.ops = ops  # torch.ops.radixserve_cpu when lora_sgmv may run (CPU, kernels loaded, one rank)
        kernel_dtype = weight_dtype if weight_dtype in (torch.float32, torch.bfloat16) else torch.float32
        self.dtype = kernel_dtype if ops is not None else dtype  # dtype: the activations'
        self.limit = limit
        self._adapters: list[LoRAAdapter] = []
        self.index: dict[int, int] = {}  # uid -> its group in the layout

    def get(self, adapters: list[LoRAAdapter]) -> tuple[dict[str, DenseWeights], dict[int, int]]:
        """The layout holding `adapters`, and each one's group (uid -> index in the layout)."""
        uids = [a.uid for a in adapters]
        if self.ops is None:
            layout = adapters if tuple(uids) != self.key else self._adapters
        else:
            held = set(self.key or ())
            new = [a for a in adapters if a.uid not in held]
            layout = self._adapters + new if len(held) + len(new) <= self.limit else adapters
        if tuple(a.uid for a in layout) != self.key:
            self.key, self._adapters = tuple(a.uid for a in layout), list(layout)
            self.index = {uid: g for g, uid in enumerate(self.key)}
            self.weights = concat_adapters(layout, self.dtype, transposed=self.ops is not None)
        return self.weights, self.index

    def forget(self, uid: int) -> None:
        """Adapter `uid` leaves memory (unloaded, or dropped by the LRU): a layout holding it goes too."""
        if self.key is not None and uid in self.key:
            self.drop()

    def drop(self) -> None:
        self.key, self.weights, self._adapters, self.index = None, {}, [], {}
