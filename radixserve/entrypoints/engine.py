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

from radixserve.entrypoints.replicas import Replicas, start_replicas
from radixserve.managers.embedding_request import check_options, embedding_input, encode_vector
from radixserve.managers.io_struct import GenerateReqInput, ShutdownReq, TokenizedGenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.mem_cache.hicache_stop import scheduler_stop_timeout
from radixserve.model_loader import get_tokenizer
from radixserve.server_args import ServerArgs

PROGRESS_BAR_MIN_BATCH = 16


def _public(out: dict[str, Any]) -> dict[str, Any]:
    return {"text": out["text"], "output_ids": list(out["output_ids"]), "meta_info": out["meta_info"]}


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if self.server_args.node_rank != 0:
            raise ValueError(f"ServerArgs.node_rank: the Engine is node 0 (it receives the requests); start node "
                             f"{self.server_args.node_rank} with `radixserve serve --node-rank "
                             f"{self.server_args.node_rank} ...`")
        # the scheduler process(es) load the model while this one loads the tokenizer
        pending = start_replicas(self.server_args)
        try:
            self.tokenizer = get_tokenizer(self.server_args.resolved_model_path(), self.server_args.tokenizer_path,
                                           self.server_args.chat_template)
            self.handle: Replicas | None = pending.wait()
        except BaseException:
            pending.kill()
            raise
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="radixserve-engine", daemon=True)
        self.thread.start()
        handle = self.handle

        async def make() -> TokenizerManager:
            return TokenizerManager(self.tokenizer, handle.to_scheduler, handle.from_scheduler, handle.info,
                                    self.server_args)

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
                self.loop.call_soon_threadsafe(self.tm.fail_all, handle.death_reason())
                return

    # ------------------------------------------------------------------ inputs
    def _normalize(self, prompt: Any, input_ids: Any, sampling_params: Any, rid: str | None, timeout: float | None,
                   **flags: Any) -> tuple[list[TokenizedGenerateReqInput], bool]:
        """The one normalisation path (RequestNormalizer): a bad item raises before anything runs."""
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                               timeout=timeout, **flags)
        return self._run(self._normalize_on_loop(obj))

    async def _normalize_on_loop(self, obj: GenerateReqInput, embed: bool = False
                                 ) -> tuple[list[TokenizedGenerateReqInput], bool]:
        return await self.tm.normalize_async(obj, embed)  # on the loop's thread: tm.states is read there

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
        rid: str | None = None,
        timeout: float | None = None,
        lora_path: str | None = None,  # a loaded LoRA adapter's name (--lora-paths); None = the base model
        image_data: list[Any] | list[list[Any]] | None = None,  # a vision-language model's images (see GenerateReqInput)
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Returns a dict (or a list for batch input); with stream=True, an iterator of
        incremental dicts whose "text" and "output_ids" hold only what is new."""
        subs, is_batch = self._normalize(prompt, input_ids, sampling_params, rid, timeout,
                                         return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                                         return_prompt_logprob=return_prompt_logprob, stream=stream,
                                         lora_path=lora_path, image_data=image_data)
        if stream:
            if is_batch:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream_sync(subs[0])
        futures = [self._submit(self._one(sub)) for sub in subs]
        show = self.server_args.show_progress and len(futures) >= PROGRESS_BAR_MIN_BATCH
        if show:
            with tqdm(total=len(futures), desc="generate", unit="req") as bar:
                for f in futures:
                    f.add_done_callback(lambda _f: bar.update(1))
                results = [f.result() for f in futures]
        else:
            results = [f.result() for f in futures]
        return results if is_batch else results[0]

    async def _one(self, sub: TokenizedGenerateReqInput) -> dict[str, Any]:
        return _public(await self._last(sub))

    def _stream_sync(self, sub: TokenizedGenerateReqInput) -> Iterator[dict[str, Any]]:
        agen = self.tm.generate_request(sub)
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
        rid: str | None = None,
        timeout: float | None = None,
        lora_path: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like generate(), awaitable from any event loop."""
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                               timeout=timeout, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                               return_prompt_logprob=return_prompt_logprob, stream=stream, lora_path=lora_path)
        subs, is_batch = await asyncio.wrap_future(self._submit(self._normalize_on_loop(obj)))
        if stream:
            if is_batch:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream_async(subs[0])
        futs = [asyncio.wrap_future(self._submit(self._one(sub))) for sub in subs]
        results = await asyncio.gather(*futs)
        return list(results) if is_batch else results[0]

    async def _stream_async(self, sub: TokenizedGenerateReqInput) -> AsyncIterator[dict]:
        agen = self.tm.generate_request(sub)
        try:
            while True:
                try:
                    out = await asyncio.wrap_future(self._submit(agen.__anext__()))
                except StopAsyncIteration:
                    return
                yield {"text": out["delta"], "output_ids": out["new_token_ids"], "meta_info": out["meta_info"]}
        finally:
            await asyncio.wrap_future(self._submit(agen.aclose()))

    # ------------------------------------------------------------------ embeddings
    def encode(self, prompt: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
               rid: str | None = None, timeout: float | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """An embedding server's (--is-embedding) vectors: `prompt` is a text, a list of texts, token ids or a
        list of those (as /v1/embeddings' `input`); each answer is {"embedding": [float], "meta_info": {...}},
        pooled and L2-normalised (`dimensions`: the first ones, renormalised). A list for a batch."""
        subs, is_batch = self._run(self._normalize_on_loop(embedding_input(prompt, rid, timeout), embed=True))
        check_options(dimensions, "float", self.tm.hidden_size)
        outs = [f.result() for f in [self._submit(self._last(sub)) for sub in subs]]
        for out in outs:
            if "embedding" not in out:
                raise RuntimeError(f"request {out['meta_info'].get('id')} was aborted before its embedding was pooled")
        results = [{"embedding": encode_vector(o["embedding"], dimensions, "float"), "meta_info": o["meta_info"]}
                   for o in outs]
        return results if is_batch else results[0]

    async def _last(self, sub: TokenizedGenerateReqInput) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for out in self.tm.generate_request(sub):
            last = out
        return last

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str) -> list[str]:
        """Abort `rid` (exactly, and the rid-i sub-requests of a batch / n call made with it)."""
        return self._run(self.tm.abort_request(rid))

    def flush_cache(self, storage: bool = False) -> bool:
        """Empty the radix cache (False while requests run); `storage`: the disk tier too."""
        return self._run(self.tm.flush_cache(storage))

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self.tm.get_server_info())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.handle is not None:
            if self.handle.is_alive():
                self.loop.call_soon_threadsafe(self.tm.send, ShutdownReq())  # sockets live on the loop's thread
            self.handle.stop(scheduler_stop_timeout(self.server_args, 5.0))
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
