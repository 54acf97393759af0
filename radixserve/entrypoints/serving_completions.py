"""POST /v1/completions: OpenAI's legacy text completions (prompt lists, echo, logprobs, SSE)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from radixserve.entrypoints.openai_serving import (
    SSE_DONE,
    APIError,
    RequestGroup,
    SSEResponse,
    SubRequest,
    finish_reason,
    parse_body,
    sse,
    sse_error,
    trim_stop_token,
)
from radixserve.entrypoints.serving_base import OpenAIServingBase

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported (use n)", "best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        top_k = self.check_top_logprobs(req.logprobs, "logprobs")
        prompts = self._prompts(req.prompt)
        params = self.sampling_params(req, DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens)
        rid = req.rid or f"cmpl-{uuid.uuid4().hex}"
        subs = self.fan_out(prompts, params, rid)
        want_logprobs = req.logprobs is not None
        group = RequestGroup(self.tm, subs, metrics=self.metrics, return_logprob=want_logprobs,
                             top_logprobs_num=top_k, return_prompt_logprob=want_logprobs and bool(req.echo))
        if req.stream:
            return SSEResponse(self._stream(request, req, rid, subs, group, top_k, params.n), group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        choices = []
        for i, (sub, out) in enumerate(zip(subs, outs)):
            reason, matched = finish_reason(out["meta_info"])
            text = (self._prompt_text(sub) if req.echo else "") + out["text"]
            logprobs = self._logprobs(sub, out, req.echo, top_k) if want_logprobs else None
            choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason,
                                            matched_stop=matched))
        usage = self.usage(outs, params.n)
        resp = CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump())

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """str | list[str] | list[int] | list[list[int]] -> token id lists."""
        if isinstance(prompt, str):
            return [self.tokenize_prompt(prompt, None)]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if isinstance(prompt[0], str):
            return [self.tokenize_prompt(p, None) for p in prompt]
        if isinstance(prompt[0], int):
            return [self.tokenize_prompt(None, prompt)]
        return [self.tokenize_prompt(None, p) for p in prompt]

    def _prompt_text(self, sub: SubRequest) -> str:
        return self.tokenizer.decode(sub.input_ids, skip_special_tokens=sub.params.skip_special_tokens)

    def _logprobs(self, sub: SubRequest, out: dict[str, Any], echo: bool, top_k: int, start: int = 0,
                  offset: int = 0, final: bool = True) -> CompletionLogprobs:
        """OpenAI's legacy shape for output tokens [start:] (plus the prompt's when echo).

        NOTE: prompt logprobs cover only the prompt tokens the scheduler computed; a prefix it
        found in the radix cache was not recomputed, so those positions are null.
        """
        meta = out["meta_info"]
        lp = CompletionLogprobs()

        def add(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(text)

        if echo:
            values = list(meta.get("input_token_logprobs") or [])
            aligned: list[float | None] = [None] * (len(sub.input_ids) - len(values)) + values
            for token_id, value in zip(sub.input_ids, aligned):
                add(token_id, value, None if value is None else {self.token_text(token_id): value})
        end = trim_stop_token(out) if final else len(out["output_ids"])
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        for k in range(start, min(end, len(pairs))):
            logprob, token_id = pairs[k]
            top = {self.token_text(t): v for t, v in (tops[k] if k < len(tops) else [])[:top_k]}
            # OpenAI always includes the sampled token, so there may be top_k + 1 entries.
            top.setdefault(self.token_text(token_id), logprob)
            add(token_id, logprob, top)
        return lp

    async def _stream(self, request: Request, req: CompletionRequest, rid: str, subs: list[SubRequest],
                      group: RequestGroup, top_k: int, n: int) -> AsyncIterator[str]:
        created = int(time.time())
        sent_tokens = [0] * len(subs)  # output tokens whose logprobs went out, per choice
        offsets = [0] * len(subs)  # text_offset of the next token, per choice
        finals: list[dict[str, Any]] = [{} for _ in subs]

        def chunk(i: int, text: str, logprobs: CompletionLogprobs | None, reason: str | None = None,
                  matched: Any = None) -> str:
            choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            return sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice]))

        try:
            if req.echo:
                for i, sub in enumerate(subs):
                    text = self._prompt_text(sub)
                    offsets[i] = len(text)
                    yield chunk(i, text, None)
            async for i, out in group.events(request):
                reason, matched = finish_reason(out["meta_info"])
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(subs[i], out, False, top_k, sent_tokens[i], offsets[i],
                                              out["finished"])
                    sent_tokens[i] = len(out["output_ids"])
                    offsets[i] += sum(len(t) for t in logprobs.tokens)
                if out["delta"] or reason or (logprobs and logprobs.tokens):
                    yield chunk(i, out["delta"], logprobs, reason, matched)
                if out["finished"]:
                    finals[i] = out
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage(finals, n)
                yield sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                             usage=usage))
        except ConnectionAbortedError:
            return
        except Exception as e:  # noqa: BLE001  # the 200 headers are out: report in-band, then end the stream
            yield sse_error(e)
        finally:
            group.cancel()
        yield SSE_DONE
