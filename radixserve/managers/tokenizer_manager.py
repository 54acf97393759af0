"""TokenizerManager: the main process's side of every request (asyncio).

    text / chat -> tokenise, validate -> TokenizedGenerateReqInput --ZMQ--> scheduler
    ReqOutput (token ids) <--ZMQ-- scheduler -> incremental detokenise -> stream or final dict

It owns per-request state (ReqState) and is shared by the offline Engine and the HTTP server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.managers.detokenizer import IncrementalDetokenizer
from radixserve.managers.io_struct import (
    AbortReq,
    BatchReqOutput,
    FlushCacheReq,
    GetServerInfoReq,
    ReqOutput,
    RpcOutput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: list[float] | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished: bool = False


class SchedulerDied(RuntimeError):
    pass


class TokenizerManager:
    def __init__(self, tokenizer: Any, to_scheduler: str, from_scheduler: str, info: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.context_len: int = info["context_len"]
        self.vocab_size: int = info["vocab_size"]
        self.max_total_num_tokens: int = info["max_total_num_tokens"]
        self.ctx = zmq.asyncio.Context(1)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(to_scheduler)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(from_scheduler)
        self.states: dict[str, ReqState] = {}
        self.rpc_waiters: dict[str, asyncio.Future] = {}
        self.rpc_lock: asyncio.Lock | None = None
        self.loop_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.metrics: Any = None  # set by the HTTP server (Prometheus collectors)

    # ------------------------------------------------------------------ input
    def tokenize(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if input_ids is not None:
            if text is not None:
                raise ValueError("prompt: give either text or input_ids, not both")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("input_ids: must be a list of integers")
            return list(input_ids)
        if text is None:
            raise ValueError("prompt: either text or input_ids is required")
        if not isinstance(text, str):
            raise ValueError("prompt: must be a string")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        params.verify(self.vocab_size)
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens is longer than the context allows ({self.context_len} tokens "
                "including at least one generated token)"
            )

    def _ensure_loop(self) -> None:
        if self.loop_task is None:
            self.rpc_lock = asyncio.Lock()
            self.loop_task = asyncio.get_running_loop().create_task(self.handle_loop())

    async def generate_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_prompt_logprob: bool = False,
        stream: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield output dicts ({text, output_ids, meta_info}); one at the end unless stream."""
        self._ensure_loop()
        if self.dead_reason:
            raise SchedulerDied(self.dead_reason)
        self.validate(input_ids, params)
        rid = rid or uuid.uuid4().hex
        if rid in self.states:
            raise ValueError(f"rid: request id {rid!r} is already in use")
        state = ReqState(rid, len(input_ids), IncrementalDetokenizer(self.tokenizer, params))
        self.states[rid] = state
        msg = TokenizedGenerateReqInput(
            rid, input_ids, params, return_logprob, top_logprobs_num, return_prompt_logprob, stream, priority
        )
        await self.send_sock.send_pyobj(msg)
        try:
            while True:
                out: ReqOutput | str = await state.queue.get()
                if isinstance(out, str):  # the scheduler died
                    raise SchedulerDied(out)
                if out.error is not None:
                    raise ValueError(out.error)
                result = self._apply(state, out)
                if out.finished_reason is not None:
                    yield result
                    return
                if stream:
                    yield result
        finally:
            if not state.finished:
                await self.abort_request(rid)  # the caller went away (disconnect, cancel)
            self.states.pop(rid, None)

    def _apply(self, state: ReqState, out: ReqOutput) -> dict[str, Any]:
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.perf_counter()
        state.output_ids.extend(out.new_token_ids)
        state.output_token_logprobs.extend(out.output_token_logprobs)
        state.output_top_logprobs.extend(out.output_top_logprobs)
        if out.input_token_logprobs is not None:
            state.input_token_logprobs = out.input_token_logprobs
        finished = out.finished_reason is not None
        state.finished = finished
        text, delta = state.detok.update(state.output_ids, out.finished_reason)
        meta = dict(out.meta_info)
        now = time.perf_counter()
        meta["id"] = state.rid
        if state.first_token_time is not None and "ttft" not in meta:
            meta["ttft"] = state.first_token_time - state.created
        if finished:
            meta["e2e_latency"] = now - state.created
        if state.output_token_logprobs or state.input_token_logprobs is not None:
            meta["output_token_logprobs"] = list(zip(state.output_token_logprobs, state.output_ids))
            meta["output_top_logprobs"] = list(state.output_top_logprobs)
            if state.input_token_logprobs is not None:
                meta["input_token_logprobs"] = list(state.input_token_logprobs)
        if finished and self.metrics is not None:
            self.metrics.observe_finished(meta, now - state.created, state.first_token_time, state.created)
        return {"text": text, "delta": delta, "output_ids": list(state.output_ids), "meta_info": meta,
                "new_token_ids": list(out.new_token_ids), "finished": finished}

    async def abort_request(self, rid: str) -> None:
        if not self.dead_reason:
            await self.send_sock.send_pyobj(AbortReq(rid))

    # ------------------------------------------------------------------ control
    async def _rpc(self, msg: Any, kind: str) -> RpcOutput:
        self._ensure_loop()
        if self.dead_reason:
            raise SchedulerDied(self.dead_reason)
        assert self.rpc_lock is not None
        async with self.rpc_lock:
            fut = asyncio.get_running_loop().create_future()
            self.rpc_waiters[kind] = fut
            await self.send_sock.send_pyobj(msg)
            return await fut

    async def flush_cache(self) -> bool:
        return (await self._rpc(FlushCacheReq(), "flush_cache")).ok

    async def get_server_info(self) -> dict[str, Any]:
        info = (await self._rpc(GetServerInfoReq(), "server_info")).data
        # CPU seconds of this process (HTTP, tokenisation, detokenisation), next to the scheduler's split.
        info.setdefault("time_split", {})["tokenizer_process_cpu_s"] = time.process_time()
        return info

    # ------------------------------------------------------------------ output
    async def handle_loop(self) -> None:
        while True:
            msg = await self.recv_sock.recv_pyobj()
            if isinstance(msg, RpcOutput):
                fut = self.rpc_waiters.pop(msg.kind, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            assert isinstance(msg, BatchReqOutput)
            for out in msg.outputs:
                state = self.states.get(out.rid)
                if state is not None:
                    state.queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The scheduler process is gone: every waiting caller gets an error, not a hang."""
        self.dead_reason = reason
        for state in self.states.values():
            state.queue.put_nowait(reason)
        for fut in self.rpc_waiters.values():
            if not fut.done():
                fut.set_exception(SchedulerDied(reason))

    async def close(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            try:
                await self.loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.send_sock.close(linger=0)
        self.recv_sock.close(linger=0)
        self.ctx.term()
