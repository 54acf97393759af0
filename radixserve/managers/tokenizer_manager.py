"""TokenizerManager: the main process's side of every request (asyncio).

    text / chat -> tokenise, validate -> TokenizedGenerateReqInput --ZMQ--> scheduler
    ReqOutput (token ids) <--ZMQ-- scheduler -> incremental detokenise -> stream or final dict

It owns per-request state (ReqState) and is shared by the offline Engine and the HTTP server.
With --dp-size N it talks to N replicas through a DataParallelController (which picks the replica of
each request; every replica pushes its outputs to the one socket this process binds) and merges the
replicas' answers to control calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.exceptions import QueueFull, RequestError, SchedulerDied, ServerUnavailable
from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.detokenizer import IncrementalDetokenizer
from radixserve.managers.embedding_request import check_server_kind
from radixserve.managers.io_struct import (
    BatchReqOutput,
    FlushCacheReq,
    GenerateReqInput,
    GetRadixTreeReq,
    GetServerInfoReq,
    ReqOutput,
    RpcOutput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
from radixserve.managers.server_info import merge_replica_infos
from radixserve.multimodal.image_loader import MediaLimits
from radixserve.multimodal.processors import get_mm_processor
from radixserve.server_args import ServerArgs


@dataclass
class ReqState:
    rid: str
    parent_rid: str | None
    prompt_tokens: int
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: list[float] | None = None
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)  # token_ids_logprob's rows
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished: bool = False
    # The caller went away before the end: the state stays (a tombstone, its outputs dropped)
    # until the scheduler's final output for the rid arrives, so a new request reusing the rid
    # right away is refused instead of receiving the old request's tokens.
    abandoned: bool = False


# After this many requests in a row failed while running (500), /health answers 503: the model
# itself is likely broken, and a supervisor should restart the server.
UNHEALTHY_AFTER_FAILED_REQUESTS = 8


@dataclass
class _RpcCall:
    """A control call broadcast to `expected` replicas: done when each has answered."""

    fut: asyncio.Future
    expected: set[int]
    answers: dict[int, RpcOutput] = field(default_factory=dict)


class TokenizerManager:
    def __init__(self, tokenizer: Any, to_scheduler: str | list[str], from_scheduler: str, info: dict[str, Any],
                 server_args: ServerArgs) -> None:
        """to_scheduler: the address of each replica's rank 0 (one without data parallel); info: what the
        schedulers reported when ready (max_total_num_tokens: the smallest replica's pool)."""
        self.tokenizer = tokenizer
        self.server_args = server_args
        self.context_len: int = info["context_len"]
        self.vocab_size: int = info["vocab_size"]
        self.max_total_num_tokens: int = info["max_total_num_tokens"]
        self.hidden_size: int = info.get("hidden_size", 0)  # an embedding's size (/v1/embeddings `dimensions`)
        self.num_labels: int = info.get("num_labels", 0)  # a sequence classifier's labels (rerank, score); 0: none
        self.limits = RequestLimits.build(server_args, self.context_len, self.vocab_size, self.max_total_num_tokens)
        self.mm_processor = get_mm_processor(server_args.resolved_model_path(), self.vocab_size, tokenizer,
                                             server_args.mmproj)
        self.normalizer = RequestNormalizer(tokenizer, self.limits, self.mm_processor,
                                            MediaLimits.from_server_args(server_args))
        addresses = [to_scheduler] if isinstance(to_scheduler, str) else list(to_scheduler)
        self.router = DataParallelController(addresses, server_args.load_balance_method, self.max_total_num_tokens)
        # In flight = running (on every replica) + queued; beyond this a new request is a 429.
        self.max_in_flight = server_args.max_running_requests * len(addresses) + server_args.max_queued_requests
        self.ctx = zmq.asyncio.Context(1)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(from_scheduler)
        self.states: dict[str, ReqState] = {}
        self.rpc_waiters: dict[int, _RpcCall] = {}
        self.rpc_seq = 0
        self.loop_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.draining = False  # SIGTERM: running requests finish, new ones get 503
        self.failed_streak = 0  # requests in a row that failed while running (reset by any success)
        self.metrics: Any = None  # set by the HTTP server (Prometheus collectors)

    # ------------------------------------------------------------------ input
    def normalize(self, obj: GenerateReqInput, embed: bool = False, classify: bool = False,
                  prepared: list[list[Any]] | None = None) -> tuple[list[TokenizedGenerateReqInput], bool]:
        """Validated sub-requests of one call (see RequestNormalizer); also refuses a call that
        would overfill the queue, before any of it is sent, and one of the other server kind (`embed`:
        an embedding call, `classify`: a classifier's scores; managers/embedding_request.py)."""
        self.check_accepting()
        check_server_kind(self.server_args.is_embedding, embed or classify)
        if self.num_labels and embed:
            raise ValueError(f"input: this server serves a sequence classifier ({self.num_labels} labels), not "
                             "embeddings: it answers /v1/rerank and /v1/score")
        subs, is_batch = self.normalizer.normalize(obj, prepared)
        self._check_room(len(subs))
        return subs, is_batch

    async def normalize_async(self, obj: GenerateReqInput, embed: bool = False,
                              classify: bool = False) -> tuple[list[TokenizedGenerateReqInput], bool]:
        """normalize(), with the call's images decoded and processed on a worker thread (RequestNormalizer
        .prepare_images), so that a large image never stalls the event loop and the streams it serves."""
        prepared = None
        if obj.image_data is not None:
            self.check_accepting()
            prepared = await asyncio.to_thread(self.normalizer.prepare_images, obj)
        return self.normalize(obj, embed, classify, prepared)

    def unhealthy_reason(self) -> str | None:
        if self.failed_streak >= UNHEALTHY_AFTER_FAILED_REQUESTS:
            return f"the last {self.failed_streak} requests failed while running"
        return None

    def check_accepting(self) -> None:
        if self.dead_reason:
            raise SchedulerDied(self.dead_reason)
        if self.draining:
            raise ServerUnavailable("the server is shutting down and accepts no new requests")

    def _check_room(self, n: int) -> None:
        if len(self.states) + n > self.max_in_flight:
            raise QueueFull(
                f"too many requests in flight ({len(self.states)} of {self.max_in_flight}); retry later"
            )

    def send(self, msg: Any) -> None:
        """To every replica (shutdown, control calls)."""
        self.router.broadcast(msg)

    def _ensure_loop(self) -> None:
        if self.loop_task is None:
            self.loop_task = asyncio.get_running_loop().create_task(self.handle_loop())

    async def generate_request(self, req: TokenizedGenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """Yield output dicts for one validated sub-request; one at the end unless req.stream.

        Every dict has delta (new visible text), new_token_ids, new_logprobs [(logprob, id)],
        new_top_logprobs, finished and meta_info; the final one also has text and output_ids
        (and meta_info carries the full logprob lists). Nothing per step copies the whole output."""
        self._ensure_loop()
        self.check_accepting()
        rid = req.rid
        if rid in self.states:
            raise ValueError(f"rid: request id {rid!r} is already in use")
        self._check_room(1)
        state = ReqState(rid, req.parent_rid, len(req.input_ids), IncrementalDetokenizer(self.tokenizer,
                                                                                          req.sampling_params))
        self.states[rid] = state
        try:
            self.router.send_request(req)
            while True:
                out: ReqOutput | str = await state.queue.get()
                if isinstance(out, str):  # the scheduler died
                    raise SchedulerDied(out)
                if out.error is not None:
                    state.finished = True
                    if out.error_status == 500:
                        self.failed_streak += 1
                    if out.error_status == 400:
                        raise ValueError(out.error)
                    raise RequestError(out.error_status, out.error)
                result = self._apply(state, out)
                if result["finished"]:
                    self.failed_streak = 0
                    yield result
                    return
                if req.stream:
                    yield result
        finally:
            if not state.finished and not self.dead_reason and not self._final_is_queued(state):
                state.abandoned = True  # the caller went away (disconnect, cancel): see ReqState
                self.router.send_abort(rid)
            else:
                self.states.pop(rid, None)

    @staticmethod
    def _final_is_queued(state: ReqState) -> bool:
        """The scheduler's last word for this request already arrived, unread: it has dropped the
        request, so there is nothing to abort and no later output to wait for."""
        while not state.queue.empty():
            out = state.queue.get_nowait()
            if isinstance(out, str) or out.finished_reason is not None or out.error is not None:
                return True
        return False

    def _apply(self, state: ReqState, out: ReqOutput) -> dict[str, Any]:
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.perf_counter()
        start = len(state.output_ids)
        state.output_ids.extend(out.new_token_ids)
        state.output_token_logprobs.extend(out.output_token_logprobs)
        state.output_top_logprobs.extend(out.output_top_logprobs)
        state.output_token_ids_logprobs.extend(out.output_token_ids_logprobs)
        if out.input_token_logprobs is not None:
            state.input_token_logprobs = out.input_token_logprobs
        finished = out.finished_reason is not None
        state.finished = finished
        delta = state.detok.update(state.output_ids, out.finished_reason)
        meta = dict(out.meta_info)
        now = time.perf_counter()
        meta["id"] = state.rid
        if state.first_token_time is not None and "ttft" not in meta:
            meta["ttft"] = state.first_token_time - state.created
        result: dict[str, Any] = {
            "delta": delta,
            "new_token_ids": list(out.new_token_ids),
            "new_logprobs": list(zip(out.output_token_logprobs, out.new_token_ids)),
            "new_top_logprobs": list(out.output_top_logprobs),
            "finished": finished,
            "meta_info": meta,
            "start": start,  # index of new_token_ids[0] in the whole output
        }
        if out.input_token_logprobs is not None:
            meta["input_token_logprobs"] = list(out.input_token_logprobs)
        if finished:
            meta["e2e_latency"] = now - state.created
            if state.output_token_logprobs or state.input_token_logprobs is not None:
                meta["output_token_logprobs"] = list(zip(state.output_token_logprobs, state.output_ids))
                meta["output_top_logprobs"] = state.output_top_logprobs
                if state.input_token_logprobs is not None:
                    meta["input_token_logprobs"] = list(state.input_token_logprobs)
            if state.output_token_ids_logprobs:  # in the order of the request's token_ids_logprob
                meta["output_token_ids_logprobs"] = state.output_token_ids_logprobs
            result["text"] = state.detok.final_text()
            result["output_ids"] = state.output_ids
            if out.embedding is not None:  # an embedding server's answer (managers/embedding_mode.py)
                result["embedding"] = out.embedding
            if self.metrics is not None:
                self.metrics.observe_finished(meta, now - state.created, state.first_token_time, state.created)
        return result

    async def abort_request(self, rid: str) -> list[str]:
        """Abort `rid` and the sub-requests of a call made with that rid (rid-0, rid-1, ...);
        exact matches only. Returns the rids aborted."""
        if self.dead_reason:
            return []
        rids = [r for r, st in self.states.items()
                if not st.finished and not st.abandoned and (r == rid or st.parent_rid == rid)]
        for r in rids:
            self.router.send_abort(r)
        return rids

    async def abort_all(self) -> list[str]:
        rids = [r for r, st in self.states.items() if not st.finished and not st.abandoned]
        for r in rids:
            self.router.send_abort(r)
        return rids

    # ------------------------------------------------------------------ control
    async def _rpc(self, make: Any, what: str, replicas: list[int] | None = None) -> list[RpcOutput]:
        """A control call to every replica (or those listed), with a deadline: a scheduler busy in a long
        step (or wedged) yields a 503 after rpc_timeout instead of a hung HTTP handler. make(rpc_id, k)
        builds replica k's message; the answers come back in replica order."""
        self._ensure_loop()
        if self.dead_reason:
            raise SchedulerDied(self.dead_reason)
        self.rpc_seq += 1
        rpc_id = self.rpc_seq
        targets = list(range(self.router.size)) if replicas is None else replicas
        call = _RpcCall(asyncio.get_running_loop().create_future(), set(targets))
        self.rpc_waiters[rpc_id] = call
        try:
            for k in targets:
                self.router.send_to(k, make(rpc_id, k))
            await asyncio.wait_for(call.fut, self.server_args.rpc_timeout)
            return [call.answers[k] for k in targets]
        except asyncio.TimeoutError:
            silent = sorted(call.expected - call.answers.keys())
            who = "the scheduler" if self.router.size == 1 else f"the scheduler of dp rank(s) {silent}"
            raise ServerUnavailable(
                f"{what}: {who} did not answer within {self.server_args.rpc_timeout:g} s"
            ) from None
        finally:
            self.rpc_waiters.pop(rpc_id, None)

    async def flush_cache(self, storage: bool = False) -> bool:
        """Empty every replica's radix cache; `storage`: the disk tier too (a ValueError naming the field
        when the server has none: nothing would be emptied)."""
        if storage and not self.server_args.enable_hierarchical_cache:
            raise ValueError("storage: this server has no disk tier to empty (start it with "
                             "--enable-hierarchical-cache --hicache-storage-dir DIR)")
        answers = await self._rpc(lambda i, k: FlushCacheReq(rpc_id=i, storage=storage), "flush_cache")
        for a in answers:
            if a.ok:
                self.router.on_flushed(a.dp_rank)
        return all(a.ok for a in answers)

    async def get_server_info(self, steps_since: int | list[int] | None = None, steps_rid: str | None = None,
                              steps_limit: int = 64) -> dict[str, Any]:
        """Every replica's counters, merged (managers/server_info.py), with each replica's own under "dp";
        with steps_since (one step number, or one per replica as "dp_last_step" returned them), also the
        step records after it (StepLog)."""
        def since(k: int) -> int | None:
            return steps_since[k] if isinstance(steps_since, list) else steps_since

        answers = await self._rpc(lambda i, k: GetServerInfoReq(rpc_id=i, steps_since=since(k), steps_rid=steps_rid,
                                                                steps_limit=steps_limit), "get_server_info")
        info = merge_replica_infos([{**a.data, "dp_rank": a.dp_rank, **self.router.replica_stats(a.dp_rank)}
                                    for a in answers], steps_limit)
        # CPU seconds of this process (HTTP, tokenisation, detokenisation), next to the scheduler's split.
        info.setdefault("time_split", {})["tokenizer_process_cpu_s"] = time.process_time()
        info["num_in_flight_reqs"] = len(self.states)
        info["num_abandoned_reqs"] = sum(st.abandoned for st in self.states.values())
        info.update(self.router.info())
        return info

    async def get_radix_tree(self, max_nodes: int, max_depth: int, dp_rank: int = 0) -> dict[str, Any]:
        """Replica dp_rank's tree (each replica has its own cache)."""
        if not 0 <= dp_rank < self.router.size:
            raise ValueError(f"dp_rank: must be in [0, {self.router.size}), got {dp_rank}")
        msgs = await self._rpc(lambda i, k: GetRadixTreeReq(rpc_id=i, max_nodes=max_nodes, max_depth=max_depth),
                               "radix_tree", replicas=[dp_rank])
        return {**msgs[0].data, "dp_rank": dp_rank}

    # ------------------------------------------------------------------ output
    async def handle_loop(self) -> None:
        while True:
            msg = await self.recv_sock.recv_pyobj()
            if isinstance(msg, RpcOutput):
                call = self.rpc_waiters.get(msg.rpc_id)
                if call is not None and msg.dp_rank in call.expected:
                    call.answers[msg.dp_rank] = msg
                    if call.answers.keys() >= call.expected and not call.fut.done():
                        call.fut.set_result(None)
                continue
            assert isinstance(msg, BatchReqOutput)
            for out in msg.outputs:
                if out.finished_reason is not None or out.error is not None:
                    self.router.on_finished(out.rid)
                state = self.states.get(out.rid)
                if state is None:
                    continue
                if state.abandoned:  # nobody reads it; the final output retires the tombstone
                    if out.finished_reason is not None or out.error is not None:
                        del self.states[out.rid]
                    continue
                state.queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The scheduler process is gone: every waiting caller gets an error, not a hang."""
        self.dead_reason = reason
        for rid, state in list(self.states.items()):
            if state.abandoned:
                del self.states[rid]
            else:
                state.queue.put_nowait(reason)
        for call in self.rpc_waiters.values():
            if not call.fut.done():
                call.fut.set_exception(SchedulerDied(reason))

    async def close(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            try:
                await self.loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.router.close()
        self.recv_sock.close(linger=0)
        self.ctx.term()
