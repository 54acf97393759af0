"""LoRABatch: which rows of one step use which adapter, and the batched delta every targeted projection adds.

    rows of the step (tokens):  [ r0 r0 r0 | r1 | r2 r2 | r3 ]      requests r0..r3
    adapter of each request:       A         -     B       A        (- = base model)
    groups:                      A -> rows {0,1,2,6}, B -> rows {4,5}

Each projection runs its base GEMM as always (low-bit kernels included); then, per adapter group,
out[rows] += (x[rows] @ A.T) @ B.T: one pair of small GEMMs per adapter per projection per step, however
many requests share the adapter (Punica / S-LoRA's segmented matmul, grouped by adapter). A step with no
adapter row has no LoRABatch: the hooks return at once and the projections run exactly as without LoRA.

The batch is set for the duration of one forward by ModelRunner (`lora_batch_mode`), the same way the
low-bit mode is (layers/linear.py): a context variable, so runners sharing weights never mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.lora.lora_adapter import LoRAAdapter, lora_target_modules


@dataclass
class LoRAGroup:
    adapter: LoRAAdapter
    rows: torch.Tensor  # int64 token rows of this step that use the adapter


@dataclass
class LoRABatch:
    groups: list[LoRAGroup]
    # apply(x, rows, A, B, out): out[rows] += (x[rows] @ A.T) @ B.T; the C++ op when the kernels load
    apply: Callable[..., None]

    @classmethod
    def build(cls, adapters: list[LoRAAdapter | None], rows_per_req: list[int], device: torch.device,
              apply: Callable[..., None]) -> LoRABatch | None:
        """adapters: per request (None = base); rows_per_req: its token rows this step, in order."""
        if all(a is None for a in adapters):
            return None
        by_uid: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, n in zip(adapters, rows_per_req):
            if adapter is not None:
                by_uid.setdefault(adapter.uid, (adapter, []))[1].extend(range(start, start + n))
            start += n
        groups = [LoRAGroup(a, torch.tensor(rows, dtype=torch.int64, device=device)) for a, rows in by_uid.values()]
        return cls(groups, apply)


def torch_lora_apply(x: torch.Tensor, rows: torch.Tensor, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> None:
    """The reference segmented delta: out[rows] += (x[rows] @ A.T) @ B.T."""
    xs = x.index_select(0, rows).to(A.dtype)  # [n_rows, in]
    delta = (xs @ A.t()) @ B.t()  # [n_rows, rank] -> [n_rows, out]
    out.index_add_(0, rows, delta.to(out.dtype))


_LORA_BATCH: ContextVar[LoRABatch | None] = ContextVar("radixserve_lora_batch", default=None)


@contextmanager
def lora_batch_mode(batch: LoRABatch | None) -> Iterator[None]:
    token = _LORA_BATCH.set(batch)
    try:
        yield
    finally:
        _LORA_BATCH.reset(token)


def current_lora_batch() -> LoRABatch | None:
    return _LORA_BATCH.get()


def _make_hook(module_name: str) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor | None]:
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
        batch = _LORA_BATCH.get()
        if batch is None:
            return None  # base-only step: the projection's own output, untouched
        x = inputs[0]
        for group in batch.groups:
            w = group.adapter.weights.get(module_name)
            if w is not None:
                batch.apply(x, group.rows, w.A, w.B, out)
        return out

    return hook


def install_lora_hooks(model: nn.Module) -> int:
    """Add the LoRA delta to every projection an adapter may target (once per model); returns how many.
    NOTE: the hook runs after the module's forward, so a row-parallel projection's delta is added after
    its all-reduce (tp_size 1 only; ServerArgs refuses LoRA with tp_size > 1)."""
    if getattr(model, "_radixserve_lora_hooks", None) is not None:
        return len(model._radixserve_lora_hooks)
    handles = [m.register_forward_hook(_make_hook(name)) for name, m in lora_target_modules(model).items()]
    model._radixserve_lora_hooks = handles
    return len(handles)
