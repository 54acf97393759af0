"""POST /generate: the native (SGLang-style) API, token-level and without chat templates.

    {"text": "..." | [...], "input_ids": [...] | [[...]], "sampling_params": {...},
     "stream": false, "return_logprob": false, "top_logprobs_num": 0, "rid": "..."}

One prompt and n == 1 answer {text, output_ids, meta_info}; a batch (or n > 1) answers a
list in prompt x n order. Streaming sends, like SGLang, the text and ids *so far* in each
event (plus "index" for a batch), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import GenerateRequest
from radixserve.entrypoints.openai_serving import (
    RequestGroup,
    SSEResponse,
    parse_body,
    sse,
)
from radixserve.entrypoints.serving_base import OpenAIServingBase
from radixserve.managers.io_struct import GenerateReqInput


class NativeServing(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: GenerateRequest = await parse_body(request, GenerateRequest)
        obj = GenerateReqInput(
            text=req.text, input_ids=req.input_ids, sampling_params=req.sampling_params, rid=req.rid,
            return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
            return_prompt_logprob=req.return_prompt_logprob, stream=req.stream, timeout=req.timeout,
            lora_path=req.lora_path, token_ids_logprob=req.token_ids_logprob,
        )
        subs, is_batch = await self.normalize(obj, renames=None)  # native names
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        if req.stream:
            return SSEResponse(self._stream(request, group, is_batch), group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        results = [_public(o) for o in outs]
        return JSONResponse(results if is_batch else results[0])

    async def _stream(self, request: Request, group: RequestGroup, is_batch: bool) -> AsyncIterator[str]:
        # SGLang's native stream resends the text and ids so far in every event (so its size grows
        # with the output); the OpenAI routes send only what is new.
        texts = [""] * len(group.subs)
        ids: list[list[int]] = [[] for _ in group.subs]
        async for i, out in group.events(request):
            texts[i] += out["delta"]
            ids[i].extend(out["new_token_ids"])
            event = {"text": out["text"] if out["finished"] else texts[i], "output_ids": ids[i],
                     "meta_info": out["meta_info"]}
            if is_batch:
                event["index"] = i
            yield sse(event)


def _public(out: dict[str, Any]) -> dict[str, Any]:
    return {"text": out["text"], "output_ids": list(out["output_ids"]), "meta_info": out["meta_info"]}
