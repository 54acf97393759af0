"""ParallelState: which shard and which pipeline stage this process holds, and how the ranks talk.

The ModelRunner creates one ParallelState and hands it to the model, which hands it to every layer; a
layer never guesses its rank. With one rank every collective is the identity, so the single-process
path pays nothing for being parallel-ready.

Three kinds of groups (rank layout: distributed/rank_layout.py):

    TP group    the tp_size ranks of one pipeline stage: the layers' all-reduce / all-gather
                (`all_reduce`, `all_gather`, `broadcast_tensor`; the API the layers see)
    PP group    the ranks holding the same TP shard in each stage: hidden states and residuals go
                stage to stage over it with point-to-point send / recv (`send_to_next`, `recv_from_prev`)
    world       every rank of the replica, on a gloo (CPU) group whatever the device: rank 0's requests and
                clock, the last stage's sampled tokens, the agreements every scheduler needs
                (`broadcast_object`, `all_reduce_min`, `barrier`)

Backend by device: gloo on CPU (the TP and PP groups then are gloo too), NCCL on CUDA for the tensor
groups plus a separate gloo world group for Python objects. Every group has the --dist-timeout
timeout: a peer that hangs makes the op fail after it (a peer that dies fails it at once: its sockets
close). The rendezvous is the TCPStore node 0's launcher hosts at --dist-init-addr
(entrypoints/node_monitor.py), so a rank that dies never takes the store with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixserve.distributed.host_port import parse_host_port
from radixserve.distributed.rank_layout import RankLayout, stage_layers

PG_PREFIX = "pg/"  # the process group's keys in the shared store (the node monitors use "rs/")


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None  # this stage's TP group (None = the default group, which it is when pp_size is 1)
    pp_rank: int = 0
    pp_size: int = 1
    rank: int = 0  # in the world (every rank of the replica)
    layout: RankLayout = field(default_factory=RankLayout)
    pp_group: Any = None  # this TP shard's ranks across the stages
    cpu_group: Any = None  # gloo over the world (None = the default group, which is gloo on CPU)
    # expert parallelism (ServerArgs.ep_size, dividing tp_size): the TP ranks form ep_size groups of
    # tp_size / ep_size consecutive ranks; group i holds the i-th slice of whole experts, and within it the
    # experts' intermediate dimension is cut across the group's ranks (layers/moe/experts.py)
    ep_size: int = 1

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    # ------------------------------------------------------------------ tensor parallel (the layers)
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

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """TP rank `src`'s values of a tensor every rank of the stage holds in the same shape (in place)."""
        if self.tp_size > 1:
            x = x.contiguous()
            dist.broadcast(x, src=self.layout.rank_of(self.pp_rank, src), group=self.group)  # src: a world rank
        return x

    # ------------------------------------------------------------------ the world (the schedulers)
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """World rank `src`'s object on every rank: rank 0 receives requests and every rank must schedule
        the same batch; the last stage samples and every rank must append the same tokens."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """The smallest value over every rank (in place): what all of them can agree on."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    # ------------------------------------------------------------------ pipeline
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_rank(self) -> int:
        """The world rank whose sampled tokens every rank appends (TP rank 0 of the last stage)."""
        return self.layout.rank_of(self.pp_size - 1, 0)

    def stage_layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    def send_to_next(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.layout.rank_of(self.pp_rank + 1, self.tp_rank), group=self.pp_group)

    def recv_from_prev(self, x: torch.Tensor) -> torch.Tensor:
        dist.recv(x, src=self.layout.rank_of(self.pp_rank - 1, self.tp_rank), group=self.pp_group)
        return x


def init_parallel_state(
    rank: int, layout: RankLayout, dist_init_addr: str | None, device: str = "cpu", timeout_s: float = 600.0,
    connect_timeout_s: float = 120.0, ep_size: int = 1,
) -> ParallelState:
    """Join the replica's torch.distributed groups (a no-op with one rank).

    Every rank creates every group in the same order (torch.distributed requires it, members or not)."""
    if layout.tp_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide tp_size ({layout.tp_size}): experts are sharded across "
                         "the tensor-parallel ranks")
    if layout.world_size == 1:
        return ParallelState()
    if dist_init_addr is None:
        raise ValueError("ServerArgs.dist_init_addr: the launcher sets it when tp_size * pp_size > 1")
    if not dist.is_initialized():
        host, port = parse_host_port(dist_init_addr)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s))
        store.set_timeout(timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend="nccl" if device.startswith("cuda") else "gloo",
            store=dist.PrefixStore(PG_PREFIX, store),
            rank=rank,
            world_size=layout.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    timeout = timedelta(seconds=timeout_s)
    tp_rank, pp_rank = layout.tp_rank(rank), layout.pp_rank(rank)
    cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    tp_group = pp_group = None
    if layout.pp_size > 1:
        for p in range(layout.pp_size):
            g = dist.new_group(layout.stage_ranks(p), timeout=timeout)
            tp_group = g if p == pp_rank else tp_group
        for t in range(layout.tp_size):
            g = dist.new_group(layout.pipe_ranks(t), timeout=timeout)
            pp_group = g if t == tp_rank else pp_group
    return ParallelState(tp_rank=tp_rank, tp_size=layout.tp_size, group=tp_group, pp_rank=pp_rank,
                         pp_size=layout.pp_size, rank=rank, layout=layout, pp_group=pp_group, cpu_group=cpu_group,
                         ep_size=ep_size)
