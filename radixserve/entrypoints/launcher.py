"""Start this node's scheduler process(es) and wait until the model is loaded (shared by Engine and server).

Each scheduler runs as `python -m radixserve.managers.scheduler_process` (a fresh interpreter,
not multiprocessing): user scripts need no `if __name__ == "__main__"` guard, and nothing of
the parent's threads or CUDA state is inherited. Its arguments arrive pickled on stdin; it
reports 'ready' (or its start-up error) on a ZMQ socket.

With --tp-size N --pp-size M there are N x M ranks (distributed/rank_layout.py numbers them), spread
evenly over --nnodes machines; this node starts its share. They rendezvous at --dist-init-addr (default
127.0.0.1 and a free port), where node 0's launcher hosts a TCPStore: hosted here rather than in rank 0,
so that a rank that dies never takes the rendezvous with it, and the NodeMonitor (node_monitor.py) can use
the same store for heartbeats and failure reports between nodes. Only rank 0 talks to the
TokenizerManager; it broadcasts what it receives to the other ranks (managers/scheduler_process.py).

The model's sizes are checked against tp_size / pp_size here, before any process starts, so bad sizes
fail in a second with a message naming them, never after the weights load.

This starts one such group (a replica). With --dp-size N, entrypoints/replicas.py starts N of them:
start_scheduler() spawns each (so they load at once), PendingScheduler.wait_ready() awaits each.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.distributed.rank_layout import RankLayout, check_model_fits
from radixserve.entrypoints.node_monitor import GRACE_S, NodeMonitor, open_rendezvous
from radixserve.managers.scheduler_process import SchedulerPorts
from radixserve.model_loader import get_model_config
from radixserve.server_args import ServerArgs

STOP_GRACE_S = 2.0  # a rank blocked in a collective runs no Python signal handler: SIGKILL after this


@dataclass
class SchedulerHandle:
    procs: dict[int, subprocess.Popen]  # this node's ranks
    ports: SchedulerPorts
    info: dict[str, Any]  # what rank 0 (on node 0; else this node's first rank) reported when ready
    ipc_dir: str
    monitor: NodeMonitor

    @property
    def process(self) -> subprocess.Popen | None:
        """Rank 0's process (None on a node other than 0)."""
        return self.procs.get(0)

    def failure(self) -> str | None:
        """Why the replica cannot go on (naming the rank or node), or None while every rank is alive."""
        return self.monitor.failure

    def is_alive(self) -> bool:
        """All ranks alive, here and on the other nodes: one dead rank stalls the others' collectives."""
        return self.monitor.failure is None

    def stop(self, timeout: float = 5.0) -> None:
        """`timeout`: how long the ranks may take to finish on their own (after a ShutdownReq); none after a
        failure (a hung rank would never finish)."""
        failed = self.monitor.failure is not None
        self.monitor.stop()
        stop_processes(list(self.procs.values()), 0.0 if failed else timeout)
        self.monitor.wait_for_nodes_to_leave(timeout)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    """Let them exit on their own for `timeout` (they may be finishing a step after a ShutdownReq), then
    SIGTERM, then SIGKILL: all at once, so stopping N ranks takes no longer than stopping one."""
    deadline = time.monotonic() + timeout
    for action in (None, "terminate", "kill"):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            if action is not None:
                getattr(p, action)()
        end = deadline if action is None else time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_scheduler(server_args: ServerArgs, timeout_s: float = 900.0, from_scheduler: str | None = None,
                     dp_rank: int = 0, env: dict[str, str] | None = None) -> SchedulerHandle:
    """Start this node's ranks of one scheduler group (one replica) and wait until they are ready.

    from_scheduler: where its outputs go (default: a fresh address; data parallel gives every replica the
    TokenizerManager's one address); dp_rank names the replica in its logs and answers; env: its environment."""
    return start_scheduler(server_args, from_scheduler, dp_rank, env).wait_ready(timeout_s)


@dataclass
class PendingScheduler:
    """A replica whose processes are started and loading: several load at once (entrypoints/replicas.py)."""

    procs: dict[int, subprocess.Popen]  # this node's ranks
    ports: SchedulerPorts
    ipc_dir: str
    ready: Any  # the PULL socket each rank reports 'ready' (or its start-up error) on
    monitor: NodeMonitor
    layout: RankLayout

    def kill(self) -> None:
        self.monitor.stop()
        stop_processes(list(self.procs.values()), 0.0)
        self.ready.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def wait_ready(self, timeout_s: float = 900.0) -> SchedulerHandle:
        """Every local rank's 'ready' message, or the first start-up failure (here or on another node) raised."""
        try:
            msgs = self._wait(timeout_s)
        except BaseException:
            self.kill()
            raise
        self.ready.close(linger=0)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return SchedulerHandle(self.procs, self.ports, msgs[min(msgs)], self.ipc_dir, self.monitor)

    def _wait(self, timeout_s: float) -> dict[int, dict[str, Any]]:
        msgs: dict[int, dict[str, Any]] = {}
        errors: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        first_error: float | None = None
        while len(msgs) < len(self.procs):
            if self.ready.poll(500):
                m = self.ready.recv_pyobj()
                rank = int(m.get("rank", 0))
                if m.get("status") == "ready":
                    msgs[rank] = m
                    continue
                errors[rank] = m
                first_error = first_error or time.monotonic()
                if not m.get("peer_lost"):  # the cause: tell the other nodes and stop
                    self.monitor.report(self._start_error_text(rank, m))
                    _raise_start_error(m, self.monitor.failure)
            if self.monitor.failure is not None:
                raise RuntimeError(f"scheduler failed to start: {self.monitor.failure}")
            if first_error is not None and time.monotonic() - first_error > GRACE_S:
                rank = min(errors)  # only ranks that lost a peer reported: name one
                self.monitor.report(self._start_error_text(rank, errors[rank]))
                _raise_start_error(errors[rank], self.monitor.failure)
            if time.monotonic() > deadline:
                raise RuntimeError("scheduler process did not become ready in time")
        return msgs

    def _start_error_text(self, rank: int, msg: dict[str, Any]) -> str:
        error = str(msg.get("error"))
        return error if self.layout.world_size == 1 else f"{self.layout.describe(rank)}: {error}"


def _raise_start_error(msg: dict[str, Any], text: str | None) -> None:
    # NOTE: ValueError for bad configuration (unknown architecture, missing file...) so
    # callers see the same exception type the loader raised.
    exc = ValueError if msg.get("exc_type") == "ValueError" else RuntimeError
    raise exc(f"scheduler failed to start: {text or msg.get('error')}")


def start_scheduler(server_args: ServerArgs, from_scheduler: str | None = None, dp_rank: int = 0,
                    env: dict[str, str] | None = None) -> PendingScheduler:
    """Spawn this node's ranks of one replica (from the calling thread: each sets PR_SET_PDEATHSIG, which
    fires when the thread that spawned it ends) without waiting for them to load."""
    layout = RankLayout(server_args.tp_size, server_args.pp_size, server_args.nnodes)
    if layout.world_size > 1 or server_args.ep_size > 1:
        # a split that cannot work fails here, once, before N processes start; one process checks for itself
        # (reading the config imports torch: ~1.3 s before the spawn, on the path to ready)
        cfg = get_model_config(server_args.resolved_model_path(), server_args.context_length)
        check_model_fits(cfg, layout.tp_size, layout.pp_size, server_args.ep_size)
    store = None
    if layout.world_size > 1:
        if server_args.dist_init_addr is None:
            server_args = server_args.replace(dist_init_addr=f"127.0.0.1:{_free_port()}")
        store = open_rendezvous(server_args)
    ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
    ports = SchedulerPorts(f"ipc://{ipc_dir}/to_scheduler", from_scheduler or f"ipc://{ipc_dir}/from_scheduler")
    ready_addr = f"ipc://{ipc_dir}/ready"
    ready = zmq.Context.instance().socket(zmq.PULL)
    ready.bind(ready_addr)
    procs: dict[int, subprocess.Popen] = {}
    for rank in layout.node_ranks(server_args.node_rank):
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.managers.scheduler_process"], stdin=subprocess.PIPE, close_fds=True,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((server_args, ports, rank, ready_addr, dp_rank)))
        proc.stdin.close()
        procs[rank] = proc
    return PendingScheduler(procs, ports, ipc_dir, ready, NodeMonitor(server_args, procs, store), layout)
