"""Replicas: the scheduler groups of one server, one per data-parallel rank (--dp-size N; 1 without it).

    start_replicas(args) -> PendingReplicas; .wait() -> Replicas  (the Engine and the HTTP server spawn first,
        then load the tokenizer and import their own modules while the replicas load the model)
        replica k = what launch_scheduler starts (tp_size * pp_size ranks), with its own arguments: its own
        --dist-init-addr port, its own --trace-batches file (FILE.dpK.EXT), its own GPUs (replica k
        sees GPUs k*n .. k*n+n-1 of those visible, n = tp * pp), dp_rank k in its logs and answers. Every replica
        pushes its outputs to replica 0's from_scheduler address, which the TokenizerManager binds;
        its DataParallelController sends each request to one replica's to_scheduler.

All replicas are spawned first, so they load their weights at the same time, then each is awaited; one
that fails to start stops the others. Afterwards a replica whose scheduler dies is a dead server: the
Engine / HTTP watchdog sees is_alive() turn False and fails every waiting request (503, exit status 1).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.launcher import PendingScheduler, SchedulerHandle, start_scheduler
from radixserve.server_args import ServerArgs


@dataclass
class Replicas:
    handles: list[SchedulerHandle]  # replica k at index k
    info: dict[str, Any]  # replica 0's ready report, with the smallest pool of any replica

    @property
    def to_scheduler(self) -> list[str]:
        return [h.ports.to_scheduler for h in self.handles]

    @property
    def from_scheduler(self) -> str:
        return self.handles[0].ports.from_scheduler

    def is_alive(self) -> bool:
        return all(h.is_alive() for h in self.handles)

    def death_reason(self) -> str:
        """Which replica died, and which of its ranks, how (once is_alive() is False)."""
        for k, h in enumerate(self.handles):
            why = h.failure()
            if why is not None:
                who = f" of dp rank {k}" if len(self.handles) > 1 else ""
                return f"scheduler process{who} died: {why}"
        return "scheduler process died"

    def stop(self, timeout: float = 5.0) -> None:
        for h in self.handles:
            h.stop(timeout)


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (all held open at once while they are picked, so none is picked twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_args(args: ServerArgs, k: int, ports: list[int]) -> ServerArgs:
    """Replica k's arguments: what must differ between replicas that run side by side. ports: one free
    port per replica, for the torch.distributed groups of TP ranks when no --dist-init-addr is given."""
    if args.dp_size == 1:
        return args
    changes: dict[str, Any] = {}
    if args.dist_init_addr is not None:  # each replica is its own torch.distributed group
        host, port = args.dist_init_addr.rsplit(":", 1)
        changes["dist_init_addr"] = f"{host}:{int(port) + k}"
    elif args.ranks_per_replica > 1:
        changes["dist_init_addr"] = f"127.0.0.1:{ports[k]}"
    if args.trace_batches:
        root, ext = os.path.splitext(args.trace_batches)
        changes["trace_batches"] = f"{root}.dp{k}{ext}"
    return args.replace(**changes)


def replica_env(args: ServerArgs, k: int) -> dict[str, str] | None:
    """CUDA: replica k sees only its own tp_size * pp_size GPUs (its ranks then use cuda:0 .. cuda:n-1)."""
    if args.dp_size == 1 or not args.device.startswith("cuda"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    per = args.ranks_per_replica
    need = args.dp_size * per
    if len(gpus) < need:
        raise ValueError(f"dp_size: {args.dp_size} replicas x tp_size * pp_size {per} need {need} GPUs, "
                         f"{len(gpus)} visible")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[k * per:(k + 1) * per])}


@dataclass
class PendingReplicas:
    """Every replica spawned and loading; wait() awaits them in turn (kill() stops them all)."""

    args: ServerArgs
    pending: list[PendingScheduler]

    def wait(self, timeout_s: float = 900.0) -> Replicas:
        handles: list[SchedulerHandle] = []
        try:
            deadline = time.monotonic() + timeout_s
            for p in self.pending:
                handles.append(p.wait_ready(max(1.0, deadline - time.monotonic())))
        except BaseException:
            for h in handles:
                h.stop(2.0)
            for p in self.pending[len(handles):]:
                p.kill()
            raise
        info = dict(handles[0].info)
        # the TokenizerManager bounds one request by a replica's pool: the smallest, should they differ
        info["max_total_num_tokens"] = min(h.info["max_total_num_tokens"] for h in handles)
        return Replicas(handles, info)

    def kill(self) -> None:
        for p in self.pending:
            p.kill()


def start_replicas(args: ServerArgs) -> PendingReplicas:
    """Spawn every replica without waiting (from the calling thread: see start_scheduler)."""
    envs = [replica_env(args, k) for k in range(args.dp_size)]  # a bad GPU count fails before anything forks
    ports = _free_ports(args.dp_size) if args.dp_size > 1 and args.ranks_per_replica > 1 else []
    pending: list[PendingScheduler] = []
    try:
        from_scheduler = None
        for k in range(args.dp_size):
            pending.append(start_scheduler(replica_args(args, k, ports), from_scheduler, k, envs[k]))
            from_scheduler = pending[0].ports.from_scheduler  # every replica's outputs go to one address
    except BaseException:
        for p in pending:
            p.kill()
        raise
    return PendingReplicas(args, pending)
