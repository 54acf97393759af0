"""Tensor-parallel state: which shard this process holds and how shards talk.

The ModelRunner creates one ParallelState and hands it to the model, which hands it to every
layer; a layer never guesses its rank. With tp_size 1 every collective is the identity, so the
single-process path pays nothing for being TP-ready.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None  # torch.distributed process group (None = the default group)

    @property
    def is_first_rank(self) -> bool:
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer over the TP ranks (in place)."""
        if self.tp_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate column-parallel shards (e.g. vocab-sharded logits) along `dim`."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s values of a tensor every rank holds in the same shape (in place)."""
        if self.tp_size > 1:
            x = x.contiguous()
            dist.broadcast(x, src=src, group=self.group)
        return x

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank 0 receives requests; every rank must schedule the same batch."""
        if self.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.tp_size > 1:
            dist.barrier(group=self.group)


def init_parallel_state(
    tp_rank: int, tp_size: int, dist_init_addr: str | None = None, device: str = "cpu", timeout_s: int = 120
) -> ParallelState:
    """Join the torch.distributed group (gloo on CPU, NCCL on GPU) when tp_size > 1.

    The timeout bounds every collective: an idle server still broadcasts every 200 ms
    (scheduler_process.py), so only a rank that died or hung makes the others fail, after timeout_s."""
    if tp_size == 1:
        return ParallelState()
    if not dist.is_initialized():
        addr = dist_init_addr or f"127.0.0.1:{os.environ.get('RADIXSERVE_DIST_PORT', '29531')}"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{addr}",
            rank=tp_rank,
            world_size=tp_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return ParallelState(tp_rank=tp_rank, tp_size=tp_size, group=None)
