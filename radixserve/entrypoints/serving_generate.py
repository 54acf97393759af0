"""POST /generate: the native (SGLang-style) API, token-level and without chat templates.

    {"text": "..." | [...], "input_ids": [...] | [[...]], "sampling_params": {...},
     "stream": false, "return_logprob": false, "top_logprobs_num": 0, "rid": "..."}

One prompt and n == 1 answer {text, output_ids, meta_info}; a batch (or n > 1) answers a
list in prompt x n order. Streaming sends, like SGLang, the text and ids *so far* in each
event (plus "index" for a batch), then `data: [DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import GenerateRequest
from radixserve.entrypoints.openai_serving import (
    SSE_DONE,
    APIError,
    RequestGroup,
    SSEResponse,
    parse_body,
    sse,
    sse_error,
)
from radixserve.entrypoints.serving_base import OpenAIServingBase
from radixserve.sampling.sampling_params import SamplingParams


class NativeServing(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: GenerateRequest = await parse_body(request, GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "prompt: give exactly one of text or input_ids", "text")
        if req.top_logprobs_num < 0:
            why = f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
            raise APIError(400, why, "top_logprobs_num")
        if isinstance(req.text, str):
            prompts, is_batch = [self.tokenize_prompt(req.text, None)], False
        elif req.text is not None:
            prompts, is_batch = [self.tokenize_prompt(t, None) for t in req.text], True
        elif req.input_ids and isinstance(req.input_ids[0], list):
            prompts, is_batch = [self.tokenize_prompt(None, x) for x in req.input_ids], True
        else:
            prompts, is_batch = [self.tokenize_prompt(None, req.input_ids)], False
        if not prompts:
            raise APIError(400, "prompt: the batch is empty", "text")
        try:
            params = SamplingParams.from_dict(req.sampling_params)
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        subs = self.fan_out(prompts, params, req.rid or uuid.uuid4().hex, renames=None)  # native names
        is_batch = is_batch or len(subs) > 1
        group = RequestGroup(self.tm, subs, metrics=self.metrics,
                             return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                             return_prompt_logprob=req.return_prompt_logprob)
        if req.stream:
            return SSEResponse(self._stream(request, group, is_batch), group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        results = [_public(o) for o in outs]
        return JSONResponse(results if is_batch else results[0])

    async def _stream(self, request: Request, group: RequestGroup, is_batch: bool) -> AsyncIterator[str]:
        try:
            async for i, out in group.events(request):
                event = _public(out)
                if is_batch:
                    event["index"] = i
                yield sse(event)
        except ConnectionAbortedError:
            return
        except Exception as e:  # noqa: BLE001  # the 200 headers are out: report in-band, then end the stream
            yield sse_error(e)
        finally:
            group.cancel()
        yield SSE_DONE


def _public(out: dict[str, Any]) -> dict[str, Any]:
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": out["meta_info"]}
