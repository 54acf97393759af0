"""The offline Engine: the same scheduler process and TokenizerManager the HTTP server uses,
driven from Python.

    with radixserve.Engine() as engine:                       # default model: SmolLM2-135M
        out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
        out["text"], out["output_ids"], out["meta_info"]

The TokenizerManager lives on an asyncio loop in a background thread, so `generate` works from
plain synchronous code and `async_generate` from any other event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any

from tqdm import tqdm

from radixserve.entrypoints.launcher import SchedulerHandle, launch_scheduler
from radixserve.managers.scheduler_process import ShutdownReq
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.model_loader import get_tokenizer
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

PROGRESS_BAR_MIN_BATCH = 16


def _public(out: dict[str, Any]) -> dict[str, Any]:
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": out["meta_info"]}


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.tokenizer = get_tokenizer(self.server_args.resolved_model_path(), self.server_args.tokenizer_path)
        self.handle: SchedulerHandle | None = launch_scheduler(self.server_args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="radixserve-engine", daemon=True)
        self.thread.start()
        ports, info = self.handle.ports, self.handle.info

        async def make() -> TokenizerManager:
            return TokenizerManager(self.tokenizer, ports.to_scheduler, ports.from_scheduler, info)

        self.tm: TokenizerManager = self._run(make())
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="radixserve-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ plumbing
    def _submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def _watch(self) -> None:
        handle = self.handle
        while handle is not None and not self._closed:
            time.sleep(0.5)
            if not handle.is_alive() and not self._closed:
                reason = f"scheduler process died (exit code {handle.process.returncode})"
                self.loop.call_soon_threadsafe(self.tm.fail_all, reason)
                return

    # ------------------------------------------------------------------ inputs
    def _normalize(
        self,
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | list[dict] | None,
    ) -> tuple[list[list[int]], list[SamplingParams], bool]:
        """Tokenise and validate everything up front: a bad item raises before anything runs."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            ids = [self.tm.tokenize(t, None) for t in texts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids = [self.tm.tokenize(None, x) for x in (input_ids if is_batch else [input_ids])]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in ids]
        for x, p in zip(ids, params):
            self.tm.validate(x, p)
        # n > 1: independent samples of the same prompt (seed + i keeps seeded runs reproducible)
        exp_ids, exp_params = [], []
        for x, p in zip(ids, params):
            for i in range(p.n):
                q = SamplingParams.from_dict({**p.to_dict(), "n": 1, "seed": None if p.seed is None else p.seed + i})
                exp_ids.append(x)
                exp_params.append(q)
        return exp_ids, exp_params, is_batch or len(exp_ids) > 1

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_prompt_logprob: bool = False,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Returns a dict (or a list for batch input); with stream=True, an iterator of
        incremental dicts whose "text" and "output_ids" hold only what is new."""
        ids, params, is_batch = self._normalize(prompt, input_ids, sampling_params)
        kw = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                  return_prompt_logprob=return_prompt_logprob)
        if stream:
            if is_batch:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream_sync(ids[0], params[0], kw)
        futures = [self._submit(self._one(x, p, kw)) for x, p in zip(ids, params)]
        show = self.server_args.show_progress and len(futures) >= PROGRESS_BAR_MIN_BATCH
        if show:
            with tqdm(total=len(futures), desc="generate", unit="req") as bar:
                for f in futures:
                    f.add_done_callback(lambda _f: bar.update(1))
                results = [f.result() for f in futures]
        else:
            results = [f.result() for f in futures]
        return results if is_batch else results[0]

    async def _one(self, ids: list[int], params: SamplingParams, kw: dict[str, Any]) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for out in self.tm.generate_request(ids, params, **kw):
            last = out
        return _public(last)

    def _stream_sync(self, ids: list[int], params: SamplingParams, kw: dict[str, Any]) -> Iterator[dict[str, Any]]:
        agen = self.tm.generate_request(ids, params, stream=True, **kw)
        try:
            while True:
                try:
                    out = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield {"text": out["delta"], "output_ids": out["new_token_ids"], "meta_info": out["meta_info"]}
        finally:
            self._run(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_prompt_logprob: bool = False,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like generate(), awaitable from any event loop."""
        ids, params, is_batch = self._normalize(prompt, input_ids, sampling_params)
        kw = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                  return_prompt_logprob=return_prompt_logprob)
        if stream:
            if is_batch:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream_async(ids[0], params[0], kw)
        futs = [asyncio.wrap_future(self._submit(self._one(x, p, kw))) for x, p in zip(ids, params)]
        results = await asyncio.gather(*futs)
        return list(results) if is_batch else results[0]

    async def _stream_async(self, ids: list[int], params: SamplingParams, kw: dict[str, Any]) -> AsyncIterator[dict]:
        agen = self.tm.generate_request(ids, params, stream=True, **kw)
        try:
            while True:
                try:
                    out = await asyncio.wrap_future(self._submit(agen.__anext__()))
                except StopAsyncIteration:
                    return
                yield {"text": out["delta"], "output_ids": out["new_token_ids"], "meta_info": out["meta_info"]}
        finally:
            await asyncio.wrap_future(self._submit(agen.aclose()))

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str) -> None:
        self._run(self.tm.abort_request(rid))

    def flush_cache(self) -> bool:
        return self._run(self.tm.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self.tm.get_server_info())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.handle is not None:
            if self.handle.is_alive():
                # NOTE: zmq.asyncio's send_pyobj returns a Future, not a coroutine, so it
                # cannot go to run_coroutine_threadsafe directly.
                async def send_shutdown() -> None:
                    await self.tm.send_sock.send_pyobj(ShutdownReq())

                self._run(send_shutdown())
            self.handle.stop()
            self.handle = None
        self._run(self.tm.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
