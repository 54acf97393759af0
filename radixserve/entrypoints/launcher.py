"""Start the scheduler process and wait until its model is loaded (shared by Engine and server).

The scheduler runs as `python -m radixserve.managers.scheduler_process` (a fresh interpreter,
not multiprocessing): user scripts need no `if __name__ == "__main__"` guard, and nothing of
the parent's threads or CUDA state is inherited. Its arguments arrive pickled on stdin; it
reports 'ready' (or its start-up error) on a ZMQ socket.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.managers.scheduler_process import SchedulerPorts
from radixserve.server_args import ServerArgs


@dataclass
class SchedulerHandle:
    process: subprocess.Popen
    ports: SchedulerPorts
    info: dict[str, Any]  # what the scheduler reported when ready
    ipc_dir: str

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        proc = self.process
        for action in (None, proc.terminate, proc.kill):
            if action is not None:
                action()
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_scheduler(server_args: ServerArgs, timeout_s: float = 900.0) -> SchedulerHandle:
    if server_args.tp_size != 1 or server_args.dp_size != 1 or server_args.nnodes != 1:
        raise ValueError("tp_size / dp_size / nnodes > 1 are not supported yet (see the README)")
    ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
    ports = SchedulerPorts(f"ipc://{ipc_dir}/to_scheduler", f"ipc://{ipc_dir}/from_scheduler")
    ready_addr = f"ipc://{ipc_dir}/ready"
    ctx = zmq.Context.instance()
    ready = ctx.socket(zmq.PULL)
    ready.bind(ready_addr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.managers.scheduler_process"], stdin=subprocess.PIPE, close_fds=True
    )
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((server_args, ports, 0, ready_addr)))
    proc.stdin.close()
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.poll(500):
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler process exited during start-up (exit code {proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError("scheduler process did not become ready in time")
        msg = ready.recv_pyobj()
    except BaseException:
        proc.kill()
        proc.wait()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    finally:
        ready.close(linger=0)
    if msg.get("status") != "ready":
        proc.wait(10)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        # NOTE: ValueError for bad configuration (unknown architecture, missing file...) so
        # callers see the same exception type the loader raised.
        exc = ValueError if msg.get("exc_type") == "ValueError" else RuntimeError
        raise exc(f"scheduler failed to start: {msg.get('error')}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return SchedulerHandle(proc, ports, msg, ipc_dir)
