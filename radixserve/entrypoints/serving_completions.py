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
    OPENAI_RENAMES,
    APIError,
    RequestGroup,
    SSEResponse,
    all_logprob_items,
    finish_reason,
    new_logprob_items,
    parse_body,
    sse_objects,
)
from radixserve.entrypoints.serving_base import UNSUPPORTED_COMPLETIONS, OpenAIServingBase, ServingRun
from radixserve.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        run = await self.run(req, request)
        if run.chunks is not None:
            assert run.group is not None
            return SSEResponse(sse_objects(run.chunks), run.group)
        return JSONResponse(run.response.model_dump())

    async def run(self, req: CompletionRequest, request: Request) -> ServingRun:
        """The call `req` asks for (req.stream picks the form); `request` is watched for a client that
        leaves. The API surfaces that translate onto this route call it too (entrypoints/surfaces.py)."""
        lora = self.check_model(req.model)  # a LoRA adapter's name selects it
        self.check_unsupported(req, UNSUPPORTED_COMPLETIONS)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported (use n)", "best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        top_k = self.check_top_logprobs(req.logprobs, "logprobs")
        text, ids = self._prompt_fields(req.prompt)
        constraint, renames = self.constraint(req)
        params = {**self.sampling_dict(req, req.max_tokens), **constraint}
        rid = req.rid or f"cmpl-{uuid.uuid4().hex}"
        want_logprobs = req.logprobs is not None
        subs, _ = await self.normalize(GenerateReqInput(
            text=text, input_ids=ids, sampling_params=params, rid=rid, return_logprob=want_logprobs,
            top_logprobs_num=top_k, return_prompt_logprob=want_logprobs and bool(req.echo), timeout=req.timeout,
            default_max_new_tokens=DEFAULT_MAX_TOKENS,  # OpenAI's, when max_tokens is absent
            lora_path=lora,
        ), {**OPENAI_RENAMES, **renames})
        n = req.n or 1
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        if req.stream:
            return ServingRun(chunks=self._stream(request, req, rid, subs, group, top_k, n), group=group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        choices = []
        for i, (sub, out) in enumerate(zip(subs, outs)):
            reason, matched = finish_reason(out["meta_info"])
            text_out = (self._prompt_text(sub) if req.echo else "") + out["text"]
            logprobs = None
            if want_logprobs:
                logprobs = CompletionLogprobs()
                if req.echo:
                    self._add_prompt_logprobs(logprobs, sub, out)
                self._add_logprobs(logprobs, all_logprob_items(out), top_k, 0)
            choices.append(CompletionChoice(index=i, text=text_out, logprobs=logprobs, finish_reason=reason,
                                            matched_stop=matched))
        usage = self.usage(outs, n)
        resp = CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)
        return ServingRun(response=resp, outs=outs)

    @staticmethod
    def _prompt_fields(prompt: Any) -> tuple[Any, Any]:
        """OpenAI's prompt (str | list[str] | list[int] | list[list[int]]) -> (text, input_ids)."""
        if isinstance(prompt, str):
            return prompt, None
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if isinstance(prompt[0], str):
            return prompt, None
        return None, prompt

    def _prompt_text(self, sub: TokenizedGenerateReqInput) -> str:
        return self.tokenizer.decode(sub.input_ids, skip_special_tokens=sub.sampling_params.skip_special_tokens)

    def _add_prompt_logprobs(self, lp: CompletionLogprobs, sub: TokenizedGenerateReqInput, out: dict[str, Any]) -> int:
        """Echoed prompt tokens. NOTE: prompt logprobs cover only the prompt tokens the scheduler
        computed; a prefix it found in the radix cache was not recomputed, so those are null."""
        values = list(out["meta_info"].get("input_token_logprobs") or [])
        aligned: list[float | None] = [None] * (len(sub.input_ids) - len(values)) + values
        offset = 0
        for token_id, value in zip(sub.input_ids, aligned):
            offset = self._add_token(lp, token_id, value, None if value is None else {self.token_text(token_id): value},
                                     offset)
        return offset

    def _add_token(self, lp: CompletionLogprobs, token_id: int, logprob: float | None,
                   top: dict[str, float] | None, offset: int) -> int:
        text = self.token_text(token_id)
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        return offset + len(text)

    def _add_logprobs(self, lp: CompletionLogprobs, items: list[tuple[float, int, list[tuple[int, float]]]],
                      top_k: int, offset: int) -> int:
        """OpenAI's legacy logprobs shape for output tokens; returns the next text_offset."""
        if lp.text_offset:
            offset = lp.text_offset[-1] + len(lp.tokens[-1])
        for logprob, token_id, alts in items:
            top = {self.token_text(t): v for t, v in alts[:top_k]}
            # OpenAI always includes the sampled token, so there may be top_k + 1 entries.
            top.setdefault(self.token_text(token_id), logprob)
            offset = self._add_token(lp, token_id, logprob, top, offset)
        return offset

    async def _stream(self, request: Request, req: CompletionRequest, rid: str,
                      subs: list[TokenizedGenerateReqInput], group: RequestGroup, top_k: int,
                      n: int) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())
        offsets = [0] * len(subs)  # text_offset of the next token, per choice
        finals: list[dict[str, Any]] = [{} for _ in subs]

        def chunk(i: int, text: str, logprobs: CompletionLogprobs | None, reason: str | None = None,
                  matched: Any = None) -> CompletionResponse:
            choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice])

        if req.echo:
            for i, sub in enumerate(subs):
                text = self._prompt_text(sub)
                offsets[i] = len(text)
                yield chunk(i, text, None)
        async for i, out in group.events(request):
            reason, matched = finish_reason(out["meta_info"])
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                offsets[i] = self._add_logprobs(logprobs, new_logprob_items(out), top_k, offsets[i])
            if out["delta"] or reason or (logprobs and logprobs.tokens):
                yield chunk(i, out["delta"], logprobs, reason, matched)
            if out["finished"]:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            usage = self.usage(finals, n)
            yield CompletionResponse(id=rid, created=created, model=self.model_name, choices=[], usage=usage)
