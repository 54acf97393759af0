"""Start the scheduler process(es) and wait until the model is loaded (shared by Engine and server).

Each scheduler runs as `python -m radixserve.managers.scheduler_process` (a fresh interpreter,
not multiprocessing): user scripts need no `if __name__ == "__main__"` guard, and nothing of
the parent's threads or CUDA state is inherited. Its arguments arrive pickled on stdin; it
reports 'ready' (or its start-up error) on a ZMQ socket.

With --tp-size N there are N of them, one per tensor-parallel rank, joined by torch.distributed
(gloo on CPU) at --dist-init-addr (default 127.0.0.1 and a free port). Only rank 0 talks to the
TokenizerManager; it broadcasts what it receives to the other ranks (managers/scheduler_process.py).

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
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.managers.scheduler_process import SchedulerPorts
from radixserve.server_args import ServerArgs


@dataclass
class SchedulerHandle:
    process: subprocess.Popen  # rank 0
    ports: SchedulerPorts
    info: dict[str, Any]  # what the scheduler reported when ready
    ipc_dir: str
    others: list[subprocess.Popen] = field(default_factory=list)  # ranks 1 .. tp_size - 1

    def is_alive(self) -> bool:
        """All ranks alive: one dead rank stalls the others' collectives, so it counts as dead."""
        return all(p.poll() is None for p in [self.process, *self.others])

    def stop(self, timeout: float = 5.0) -> None:
        for proc in [self.process, *self.others]:
            _stop(proc, timeout)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    for action in (None, proc.terminate, proc.kill):
        if action is not None:
            action()
        try:
            proc.wait(timeout)
            break
        except subprocess.TimeoutExpired:
            continue


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_scheduler(server_args: ServerArgs, timeout_s: float = 900.0, from_scheduler: str | None = None,
                     dp_rank: int = 0, env: dict[str, str] | None = None) -> SchedulerHandle:
    """Start one scheduler group (one replica: tp_size ranks) and wait until it is ready.

    from_scheduler: where its outputs go (default: a fresh address; data parallel gives every replica the
    TokenizerManager's one address); dp_rank names the replica in its logs and answers; env: its environment."""
    return start_scheduler(server_args, from_scheduler, dp_rank, env).wait_ready(timeout_s)


@dataclass
class PendingScheduler:
    """A replica whose processes are started and loading: several load at once (entrypoints/replicas.py)."""

    procs: list[subprocess.Popen]
    ports: SchedulerPorts
    ipc_dir: str
    ready: Any  # the PULL socket each rank reports 'ready' (or its start-up error) on

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.ready.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def wait_ready(self, timeout_s: float = 900.0) -> SchedulerHandle:
        procs, ready = self.procs, self.ready
        msgs: dict[int, dict[str, Any]] = {}
        try:
            deadline = time.monotonic() + timeout_s
            while len(msgs) < len(procs):
                if ready.poll(500):
                    m = ready.recv_pyobj()
                    msgs[int(m.get("tp_rank", 0))] = m
                    if m.get("status") != "ready":
                        break  # report the first failure; the other ranks are stopped below
                    continue
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"scheduler process exited during start-up (exit code {dead[0].returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError("scheduler process did not become ready in time")
        except BaseException:
            self.kill()
            raise
        ready.close(linger=0)
        msg = next((m for m in msgs.values() if m.get("status") != "ready"), msgs.get(0, {}))
        if msg.get("status") != "ready":
            for p in procs:
                _stop(p, 10)
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            # NOTE: ValueError for bad configuration (unknown architecture, missing file...) so
            # callers see the same exception type the loader raised.
            exc = ValueError if msg.get("exc_type") == "ValueError" else RuntimeError
            raise exc(f"scheduler failed to start: {msg.get('error')}")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return SchedulerHandle(procs[0], self.ports, msg, self.ipc_dir, procs[1:])


def start_scheduler(server_args: ServerArgs, from_scheduler: str | None = None, dp_rank: int = 0,
                    env: dict[str, str] | None = None) -> PendingScheduler:
    """Spawn one replica's ranks (from the calling thread: each sets PR_SET_PDEATHSIG, which fires when
    the thread that spawned it ends) without waiting for them to load."""
    if server_args.nnodes != 1:
        raise ValueError("nnodes > 1 is not supported yet (see the README)")
    if server_args.tp_size > 1 and server_args.dist_init_addr is None:
        server_args = server_args.replace(dist_init_addr=f"127.0.0.1:{_free_port()}")
    ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
    ports = SchedulerPorts(f"ipc://{ipc_dir}/to_scheduler", from_scheduler or f"ipc://{ipc_dir}/from_scheduler")
    ready_addr = f"ipc://{ipc_dir}/ready"
    ctx = zmq.Context.instance()
    ready = ctx.socket(zmq.PULL)
    ready.bind(ready_addr)
    procs: list[subprocess.Popen] = []
    for rank in range(server_args.tp_size):
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.managers.scheduler_process"], stdin=subprocess.PIPE, close_fds=True,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((server_args, ports, rank, ready_addr, dp_rank)))
        proc.stdin.close()
        procs.append(proc)
    return PendingScheduler(procs, ports, ipc_dir, ready)
