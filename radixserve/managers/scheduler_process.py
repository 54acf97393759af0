"""The scheduler process: ZMQ in, Scheduler.step(), ZMQ out.

    TokenizerManager --PUSH--> [ipc: to_scheduler]   --PULL--> SchedulerProcess
    TokenizerManager <--PULL-- [ipc: from_scheduler] <--PUSH-- SchedulerProcess

The loop blocks on the socket only when there is no work, so an idle server costs nothing and
a busy one never waits for input between steps.

Tensor parallel (--tp-size N): N processes, one per rank. Only rank 0 binds the sockets; each
iteration it broadcasts what it received, with its clock, to every rank (a gloo CPU broadcast,
also every 200 ms when idle), and every rank then handles the same messages and runs the same
step: the schedulers make the same decisions from the same inputs (timeouts use rank 0's clock;
sampled tokens are rank 0's, ModelRunner.sample), and --check-invariants compares a digest of each
step's batch across ranks. Only rank 0 sends outputs.

Data parallel (--dp-size N): N such groups, replica `dp_rank` each; all push their outputs to the one
address the TokenizerManager binds (managers/data_parallel_controller.py routes the requests).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.managers.io_struct import (
    AbortReq,
    BatchReqOutput,
    FlushCacheReq,
    GetRadixTreeReq,
    GetServerInfoReq,
    RpcOutput,
    TokenizedGenerateReqInput,
)
from radixserve.mem_cache.radix_tree_view import radix_tree_json
from radixserve.server_args import ServerArgs


@dataclass
class SchedulerPorts:
    to_scheduler: str  # ZMQ address the TokenizerManager pushes requests to
    from_scheduler: str  # ZMQ address the scheduler pushes outputs to


class ShutdownReq:
    pass


class SchedulerProcess:
    def __init__(self, server_args: ServerArgs, ports: SchedulerPorts, tp_rank: int = 0, dp_rank: int = 0) -> None:
        import torch

        from radixserve.managers.scheduler import Scheduler

        # Unseeded sampling draws from the process's torch generator, whose default seed is the same in
        # every process: without an offset, two replicas given the samples of one n > 1 call would draw
        # the same numbers. TP ranks of a replica share it (their sampled tokens are rank 0's anyway).
        torch.manual_seed(server_args.random_seed + dp_rank)
        self.scheduler = Scheduler(server_args, tp_rank=tp_rank)
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.ps = self.scheduler.model_runner.parallel_state
        self.ctx = zmq.Context(1)
        self.recv_sock = self.send_sock = None
        if tp_rank == 0:
            self.recv_sock = self.ctx.socket(zmq.PULL)
            self.recv_sock.bind(ports.to_scheduler)
            self.send_sock = self.ctx.socket(zmq.PUSH)
            self.send_sock.connect(ports.from_scheduler)
        self.parent_pid = os.getppid()
        self.running = True

    def send(self, obj: Any) -> None:
        if self.send_sock is not None:  # rank 0 only
            self.send_sock.send_pyobj(obj)

    def ready_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "max_total_num_tokens": s.allocator.total_size,
            "context_len": s.model_config.context_len,
            "vocab_size": s.model_config.vocab_size,
            "eos_token_ids": list(s.model_config.eos_token_ids),
            "weight_bytes": s.model_runner.weight_bytes,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
        }

    def recv_requests(self, block: bool) -> list[Any]:
        msgs: list[Any] = []
        # only grammars compiling: wait for messages a little instead of spinning through empty steps
        wait_ms = 200 if block else 2 if self.scheduler.only_compiling() else 0
        if wait_ms and not self.recv_sock.poll(timeout=wait_ms):
            if block and os.getppid() != self.parent_pid:  # the server died without telling us
                self.running = False
            return msgs
        while True:
            try:
                msgs.append(self.recv_sock.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return msgs

    def handle(self, msg: Any) -> None:
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            err = s.add_request(msg)
            if err is not None:
                self.send(BatchReqOutput([err]))
        elif isinstance(msg, AbortReq):
            s.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self.send(RpcOutput("flush_cache", ok=s.flush_cache(), rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, GetServerInfoReq):
            data = s.get_server_info()
            if msg.steps_since is not None:
                data.update(s.step_log.snapshot(s, msg.steps_since, msg.steps_rid, msg.steps_limit))
            self.send(RpcOutput("server_info", data=data, rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, GetRadixTreeReq):
            tree = radix_tree_json(s.tree_cache, msg.max_nodes, msg.max_depth)
            self.send(RpcOutput("radix_tree", data=tree, rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, ShutdownReq):
            self.running = False

    def event_loop(self) -> None:
        s = self.scheduler
        while self.running:
            if self.ps.tp_size == 1:
                msgs = self.recv_requests(block=not s.has_work())
            else:
                msgs = self.recv_requests(block=not s.has_work()) if self.tp_rank == 0 else []
                if self.tp_rank == 0 and not self.running:
                    msgs.append(ShutdownReq())  # the parent died: take every rank down with us
                msgs, s.clock_override = self.ps.broadcast_object((msgs, time.perf_counter()))
            for msg in msgs:
                self.handle(msg)
            if s.has_work() or s.output_processor.pending:
                outputs = s.step()
                if outputs:
                    self.send(BatchReqOutput(outputs))


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, even by SIGKILL (no orphaned schedulers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # elsewhere the getppid() check in the idle loop catches it


def run_scheduler_process(server_args: ServerArgs, ports: SchedulerPorts, tp_rank: int, ready_addr: str,
                          dp_rank: int = 0) -> None:
    """Entry point of the scheduler process; reports 'ready' (or the error) on ready_addr."""
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and tells us to stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=server_args.log_level.upper())
    ready = zmq.Context.instance().socket(zmq.PUSH)
    ready.connect(ready_addr)
    try:
        proc = SchedulerProcess(server_args, ports, tp_rank, dp_rank)
    except Exception as e:  # report any start-up failure to the parent verbatim
        where = f" (dp rank {dp_rank})" if server_args.dp_size > 1 else ""
        ready.send_pyobj({"status": "error", "exc_type": type(e).__name__, "error": f"{type(e).__name__}: {e}{where}",
                          "traceback": traceback.format_exc(), "tp_rank": tp_rank})
        ready.close(linger=2000)
        return
    ready.send_pyobj({"status": "ready", **proc.ready_info()})
    ready.close(linger=2000)
    try:
        proc.event_loop()
    except Exception as e:
        if tp_rank > 0 and "closed by peer" in str(e):
            # rank 0 is gone (stopped, or it failed and reported why itself): follow it quietly
            raise SystemExit(0) from None
        # Only faults no request could be blamed for get here (FailureIsolation pins the rest).
        where = f" of dp rank {dp_rank}" if server_args.dp_size > 1 else ""
        print(f"radixserve: the scheduler{where} stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: messages pickled by the server name
    # radixserve.managers.scheduler_process.ShutdownReq, and isinstance() must match that class.
    from radixserve.managers import scheduler_process as _module

    _module.run_scheduler_process(*pickle.loads(sys.stdin.buffer.read()))
