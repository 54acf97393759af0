"""The scheduler process: ZMQ in, Scheduler.step(), ZMQ out.

    TokenizerManager --PUSH--> [ipc: to_scheduler]   --PULL--> SchedulerProcess
    TokenizerManager <--PULL-- [ipc: from_scheduler] <--PUSH-- SchedulerProcess

The loop blocks on the socket only when there is no work, so an idle server costs nothing and
a busy one never waits for input between steps.

Tensor and pipeline parallel (--tp-size N --pp-size M): N x M processes, one per rank, possibly on
several nodes. Only rank 0 (first stage, TP rank 0) binds the sockets; each iteration it broadcasts
what it received, with its clock, to every rank (a gloo CPU broadcast, also every 200 ms when idle),
and every rank then handles the same messages and runs the same step: the schedulers make the same
decisions from the same inputs (timeouts use rank 0's clock; sampled tokens are the last stage's,
ModelRunner.sample / PipelineStage), and --check-invariants compares a digest of each step's batch
across ranks. Only rank 0 sends outputs.

Why every rank schedules rather than only the first stage's: each stage writes its layers' KV into the
same slots, so it needs the same req_to_token rows, prefix matches and allocations; running the same
deterministic scheduler gives every stage those for free, and only activations and sampled tokens travel.

A rank exits with PEER_LOST_EXIT_CODE when a collective fails because a peer's connection closed: it is
not the cause, and the launcher (entrypoints/node_monitor.py) names the rank that is.

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

from radixserve.distributed.rank_layout import RankLayout
from radixserve.managers.io_struct import (
    AbortReq,
    BatchReqOutput,
    FlushCacheReq,
    GetRadixTreeReq,
    GetServerInfoReq,
    LoRAControlReq,
    RpcOutput,
    ShutdownReq,
    TokenizedGenerateReqInput,
)
from radixserve.model_loader.readahead import start_readahead
from radixserve.model_loader.weight_check import weight_tag
from radixserve.server_args import ServerArgs

PEER_LOST_EXIT_CODE = 3  # a collective failed because a peer went away (see the docstring)
DIST_TIMEOUT_EXIT_CODE = 4  # a collective waited longer than --dist-timeout: a peer is hung or unreachable
_PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")


@dataclass
class SchedulerPorts:
    to_scheduler: str  # ZMQ address the TokenizerManager pushes requests to
    from_scheduler: str  # ZMQ address the scheduler pushes outputs to


def seed_sampling(server_args: ServerArgs, dp_rank: int = 0) -> None:
    """Unseeded sampling draws from the process's torch generator, whose default seed is the same in
    every process: without an offset, two replicas given the samples of one n > 1 call would draw
    the same numbers. The ranks of a replica share it (their sampled tokens are the last stage's anyway)."""
    import torch

    torch.manual_seed(server_args.random_seed + dp_rank)


class SchedulerProcess:
    def __init__(self, server_args: ServerArgs, ports: SchedulerPorts, rank: int = 0, dp_rank: int = 0) -> None:
        from radixserve.managers.scheduler import Scheduler  # lazy: the model stack loads in the child only

        seed_sampling(server_args, dp_rank)
        self.scheduler = Scheduler(server_args, rank=rank)
        self.rank = rank
        self.dp_rank = dp_rank
        self.ps = self.scheduler.model_runner.parallel_state
        self.ctx = zmq.Context(1)
        self.recv_sock = self.send_sock = None
        if rank == 0:
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
            "hidden_size": s.model_config.hidden_size,
            "architecture": s.model_config.architecture,  # e.g. LlamaForCausalLM (Ollama's /api/show family)
            "num_labels": s.model_config.num_labels,  # a sequence classifier's (rerank, score); 0: none
            "eos_token_ids": list(s.model_config.eos_token_ids),
            "weight_bytes": s.model_runner.weight_bytes,
            "memory_budget": s.model_runner.memory_budget.as_dict(),  # each part of this rank's memory
            "rank": self.rank,
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
            self.send(RpcOutput("flush_cache", ok=s.flush_cache(msg.storage), rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, GetServerInfoReq):
            data = s.get_server_info()
            if msg.steps_since is not None:
                data.update(s.get_steps(msg.steps_since, msg.steps_rid, msg.steps_limit))
            self.send(RpcOutput("server_info", data=data, rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, GetRadixTreeReq):
            from radixserve.mem_cache.radix_tree_view import radix_tree_json  # lazy: no torch in the launcher

            tree = radix_tree_json(s.tree_cache, msg.max_nodes, msg.max_depth)
            self.send(RpcOutput("radix_tree", data=tree, rpc_id=msg.rpc_id, dp_rank=self.dp_rank))
        elif isinstance(msg, LoRAControlReq):
            from radixserve.lora.lora_scheduling import answer_lora_control  # lazy: no torch in the launcher

            self.send(answer_lora_control(s.lora, msg, self.dp_rank))
        elif isinstance(msg, ShutdownReq):
            self.running = False

    def event_loop(self) -> None:
        s = self.scheduler
        while self.running:
            if self.ps.world_size == 1:
                msgs = self.recv_requests(block=not s.has_work())
            else:
                msgs = self.recv_requests(block=not s.has_work()) if self.rank == 0 else []
                if self.rank == 0 and not self.running:
                    msgs.append(ShutdownReq())  # the parent died: take every rank down with us
                msgs, s.clock_override = self.ps.broadcast_object((msgs, time.perf_counter()))
            for msg in msgs:
                self.handle(msg)
            if s.has_work() or s.output_processor.pending:
                outputs = s.step()
                if outputs:
                    self.send(BatchReqOutput(outputs))


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, even by SIGKILL (no orphaned schedulers). SIGKILL, not SIGTERM:
    a rank blocked in a collective runs no Python handler until the op returns, which for a hung peer is
    --dist-timeout later; and with its launcher gone nobody will use this rank again."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # elsewhere the getppid() check in the idle loop catches it


def run_scheduler_process(server_args: ServerArgs, ports: SchedulerPorts, rank: int, ready_addr: str,
                          dp_rank: int = 0) -> None:
    """Entry point of the scheduler process; reports 'ready' (or the error) on ready_addr."""
    layout = RankLayout(server_args.tp_size, server_args.pp_size, server_args.nnodes)
    where = layout.describe(rank) + (f" of dp rank {dp_rank}" if server_args.dp_size > 1 else "")
    _die_with_parent()
    # the disk reads, and the weight cache's digest is computed, while torch imports
    tag = weight_tag(server_args.quantization, (server_args.tp_size, server_args.pp_size, server_args.ep_size),
                     (layout.tp_rank(rank), layout.pp_rank(rank)))
    start_readahead(server_args.resolved_model_path(), not server_args.disable_weight_cache, tag)
    faulthandler.register(signal.SIGUSR1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and tells us to stop
    # 128 + SIGTERM, the shell's convention: the launcher tells "stopped" from "finished" (0, after ShutdownReq)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logging.basicConfig(level=server_args.log_level.upper())
    ready = zmq.Context.instance().socket(zmq.PUSH)
    ready.connect(ready_addr)
    try:
        proc = SchedulerProcess(server_args, ports, rank, dp_rank)
    except Exception as e:  # report any start-up failure to the parent verbatim
        dp = f" (dp rank {dp_rank})" if server_args.dp_size > 1 else ""
        ready.send_pyobj({"status": "error", "exc_type": type(e).__name__, "error": f"{type(e).__name__}: {e}{dp}",
                          "traceback": traceback.format_exc(), "rank": rank,
                          "peer_lost": any(p in str(e) for p in _PEER_LOST)})
        ready.close(linger=2000)
        raise SystemExit(1) from None
    ready.send_pyobj({"status": "ready", **proc.ready_info()})
    ready.close(linger=2000)
    try:
        proc.event_loop()
        proc.scheduler.tree_cache.close()  # a stop, not a failure: the disk tier saves what it holds
    except Exception as e:
        if any(p in str(e) for p in _PEER_LOST):
            # a peer is gone (stopped, or it failed and its launcher reports why): follow it quietly
            print(f"radixserve: {where}: a peer rank went away; stopping", file=sys.stderr, flush=True)
            raise SystemExit(PEER_LOST_EXIT_CODE) from None
        if "Timed out" in str(e) or "timed out" in str(e):
            print(f"radixserve: {where}: a collective timed out after --dist-timeout {server_args.dist_timeout:g} s "
                  f"(a peer rank is hung or unreachable): {e}", file=sys.stderr, flush=True)
            raise SystemExit(DIST_TIMEOUT_EXIT_CODE) from None
        # Only faults no request could be blamed for get here (FailureIsolation pins the rest).
        print(f"radixserve: {where}: the scheduler stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: what the server pickles to this process names
    # radixserve.managers.scheduler_process.SchedulerPorts, and isinstance() must match that class.
    from radixserve.managers import scheduler_process as _module
    from radixserve.process_exit import run_then_exit

    run_then_exit(_module.run_scheduler_process, *pickle.loads(sys.stdin.buffer.read()))
