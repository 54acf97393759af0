"""LoRABatch: which rows of one step use which adapter, and the batched delta every targeted projection adds.

    rows of the step (tokens):  [ r0 r0 r0 | r1 | r2 r2 | r3 ]      requests r0..r3
    adapter of each request:       A         -     B       A        (- = base model)
    groups:                      A -> rows {0,1,2,6}, B -> rows {4,5}

Each projection runs its base GEMM as always (low-bit kernels included); then, per adapter group,
out[rows] += (x[rows] @ A.T) @ B.T: one pair of small GEMMs per adapter per projection per step, however
many requests share the adapter (Punica / S-LoRA's segmented matmul, grouped by adapter). A step of few
rows (decode, verify) runs all its groups in one GEMM pair instead (lora_dense.py), inside the native decode
stack when the runner has one (kernels/cpu/csrc/decode_stack.cpp: forward_lora). A step with no
adapter row has no LoRABatch: the hooks return at once and the projections run exactly as without LoRA.

The step's LoRABatch is built with its ForwardBatch (ForwardBatch.init_new -> ModelRunner.lora_batch_for) and
travels in it (`forward_batch.lora_batch`): each projection is called with the step's ForwardBatch, and its
hook reads the batch from there, so runners sharing weights never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.lora.lora_adapter import LoRAAdapter, LoRAWeights, lora_target_modules
from radixserve.lora.lora_dense import ROW_LIMIT, DenseCache, DenseLoRA


@dataclass
class LoRAGroup:
    adapter: LoRAAdapter
    rows: torch.Tensor | slice  # token rows of this step that use the adapter (a slice when contiguous)


@dataclass
class LoRABatch:
    groups: list[LoRAGroup]
    # apply(x, rows, weights, out, ps): out[rows] += (x[rows] @ A.T) @ B.T
    apply: Callable[..., None]
    dense: DenseLoRA | None = None  # few rows, several adapters: all groups in one GEMM pair (lora_dense.py)

    @classmethod
    def build(cls, adapters: list[LoRAAdapter | None], rows_per_req: list[int], device: torch.device,
              apply: Callable[..., None], dense_cache: DenseCache | None = None) -> LoRABatch | None:
        """adapters: per request (None = base); rows_per_req: its token rows this step, in order."""
        if all(a is None for a in adapters):
            return None
        by_uid: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, n in zip(adapters, rows_per_req):
            if adapter is not None:
                by_uid.setdefault(adapter.uid, (adapter, []))[1].extend(range(start, start + n))
            start += n
        groups = [LoRAGroup(a, _rows(rows, device)) for a, rows in by_uid.values()]
        dense = None
        if dense_cache is not None and start <= ROW_LIMIT:  # one adapter too: what the native decode stack binds
            order = sorted(by_uid)  # a stable key for the cache: the set, not the batch order
            weights, index = dense_cache.get([by_uid[u][0] for u in order])
            groups_of_rows = [-1] * start
            for uid, (_, rows) in by_uid.items():
                for r in rows:
                    groups_of_rows[r] = index[uid]
            row_group = torch.tensor(groups_of_rows, dtype=torch.int64)
            dense = DenseLoRA(weights, row_group.to(device), dense_cache.ops)
        return cls(groups, apply, dense)


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def torch_lora_apply(x: torch.Tensor, rows: torch.Tensor | slice, w: LoRAWeights, out: torch.Tensor,
                     ps: Any = None) -> None:
    """The segmented delta of one adapter group: out[rows] += (x[rows] @ A.T) @ B.T.
    rows is a slice when the group's rows are contiguous (no gather, no scatter)."""
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    t = xs.to(w.A.dtype) @ w.A.t()  # [n_rows, rank]
    if w.reduce:  # row-parallel: partial sums over this rank's input features (summed in float32)
        t = ps.all_reduce(t.float()).to(w.B.dtype)
    if isinstance(rows, slice) and out.dtype == t.dtype:
        # the products accumulate in place (one pass over out, not a cast and an add more), block by block:
        # a stacked projection's B is block diagonal, and its zeros were 2-3x the flops (gate_up, qkv)
        dst = out[rows]
        for o0, on, r0, rn, b in w.block_views():
            dst[:, o0 : o0 + on].addmm_(t[:, r0 : r0 + rn], b.t())
        return
    delta = (t @ w.B.t()).to(out.dtype)  # [n_rows, out]
    if isinstance(rows, slice):
        out[rows] += delta
    else:
        out.index_add_(0, rows, delta)


def _make_hook(module_name: str, ps: Any) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor | None]:
    def hook(module: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        # inputs: the projection's (x, forward_batch); a call outside a step has no forward_batch
        forward_batch = inputs[1] if len(inputs) > 1 else None
        batch = None if forward_batch is None else forward_batch.lora_batch
        if batch is None:
            return None  # base-only step: the projection's own output, untouched
        x = inputs[0]
        if batch.dense is not None:
            batch.dense.apply(module_name, x, out, ps)
            return out
        for group in batch.groups:
            w = group.adapter.weights.get(module_name)
            if w is not None:
                batch.apply(x, group.rows, w, out, ps)
        return out

    return hook


def install_lora_hooks(model: nn.Module, ps: Any = None) -> int:
    """Add the LoRA delta to every projection an adapter may target (once per model); returns how many.
    NOTE: the hook runs after the module's forward, so a row-parallel projection's delta is added after
    its all-reduce: every rank adds the whole delta, from the all-reduced [rows, rank] product."""
    if getattr(model, "_radixserve_lora_hooks", None) is not None:
        return len(model._radixserve_lora_hooks)
    handles = [m.register_forward_hook(_make_hook(name, ps)) for name, m in lora_target_modules(model).items()]
    model._radixserve_lora_hooks = handles
    return len(handles)
