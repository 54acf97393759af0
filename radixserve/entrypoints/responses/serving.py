"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API as a translation onto the chat
route (translate.py): the request becomes a ChatCompletionRequest run by OpenAIServingChat.run, its answer (or
its stream of chunks) becomes the response object (or its events, stream.py). Stored responses live in a
bounded in-memory ResponseStore (store.py) that previous_response_id continues from.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_serving import APIError, GroupStreamingResponse, parse_body
from radixserve.entrypoints.responses.input_items import check_items, to_messages
from radixserve.entrypoints.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from radixserve.entrypoints.responses.store import ResponseStore, StoredResponse
from radixserve.entrypoints.responses.stream import ResponseEvents
from radixserve.entrypoints.responses.translate import (
    finish,
    new_id,
    rename_error,
    to_chat_request,
    to_output,
    to_tools,
    to_usage,
)
from radixserve.entrypoints.serving_base import OpenAIServingBase, ServingRun
from radixserve.entrypoints.serving_chat import OpenAIServingChat

# Fields of the Responses API this server does not build: refused (400 naming them), never dropped.
UNSUPPORTED = {
    "conversation": "conversations are not supported: continue with previous_response_id",
    "prompt": "stored prompt templates are not supported: send input and instructions",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "bounds the built-in tools, which this server does not run",
}
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted: the reasoning is returned in the clear anyway
METADATA_LIMITS = (16, 64, 512)  # OpenAI's: pairs, key length, value length


class ResponsesSSE(GroupStreamingResponse):
    """The events as they come, without chat's closing [DONE]: Responses streams end at their last event."""

    media_type = "text/event-stream"


def _check(req: ResponsesRequest) -> None:
    OpenAIServingBase.check_unsupported(req, UNSUPPORTED)
    if req.background:
        raise APIError(400, "background: background responses are not supported (stream instead)", "background")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens: must be >= 1, got {req.max_output_tokens}", "max_output_tokens")
    if req.truncation == "auto":
        raise APIError(400, "truncation: auto is not supported (an input over the context is a 400)", "truncation")
    for name in req.include or []:
        if name not in INCLUDABLE:
            raise APIError(400, f"include: {name!r} is not supported (only {', '.join(INCLUDABLE)})", "include")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity: only medium (the default) is supported", "text.verbosity")
    pairs, key_len, value_len = METADATA_LIMITS
    meta = req.metadata or {}
    if len(meta) > pairs or any(len(k) > key_len or len(v) > value_len for k, v in meta.items()):
        raise APIError(400, f"metadata: at most {pairs} pairs, keys of at most {key_len} characters and values of "
                       f"at most {value_len}", "metadata")


def _not_found(response_id: str, param: str, what: str = "Response") -> APIError:
    return APIError(404, f"{what} with id {response_id!r} not found (never stored, deleted, or evicted from the "
                    "store of the --responses-store-size most recently used)", param,
                    "previous_response_not_found" if param == "previous_response_id" else "not_found")


class ResponsesServing:
    def __init__(self, chat: OpenAIServingChat, store_size: int) -> None:
        self.chat = chat
        self.store = ResponseStore(store_size)

    async def create(self, request: Request) -> Response:
        req: ResponsesRequest = await parse_body(request, ResponsesRequest)
        _check(req)
        parent = None
        if req.previous_response_id is not None:
            parent = self.store.get(req.previous_response_id)
            if parent is None:
                raise _not_found(req.previous_response_id, "previous_response_id", "Previous response")
        items = check_items(req.input)
        messages = to_messages(req.instructions, parent.conversation() if parent else [], items)
        tools, tool_index, echoed = to_tools(req.tools)
        rid = new_id("resp")
        base = self._echo(req, rid, echoed)
        try:
            run: ServingRun = await self.chat.run(
                to_chat_request(req, messages, tools, rid, self.chat.tm.limits.context_len), request)
        except Exception as e:  # the chat pipeline's errors, naming this API's fields
            err = APIError.from_exception(e)
            if err is None:
                raise
            raise rename_error(err, tool_index) from None
        if run.chunks is not None:
            assert run.group is not None
            return ResponsesSSE(self._events(run, base, items, parent, req.store, tool_index), run.group)
        assert run.response is not None
        output, reason = to_output(run.response)
        resp = finish(base, output, reason, to_usage(run.response.usage))
        self._keep(resp, items, parent, req.store)
        return JSONResponse(resp.model_dump())

    def get(self, response_id: str, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "stream: replaying a stored response as events is not supported", "stream")
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(entry.body)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    def _echo(self, req: ResponsesRequest, rid: str, tools: list[dict[str, Any]]) -> ResponseObject:
        """The response object before the answer: the request's settings, as OpenAI echoes them."""
        fmt = req.text.format if req.text and req.text.format else None
        reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning else None
        return ResponseObject(
            id=rid, model=self.chat.model_name, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, reasoning=reasoning, store=req.store is not False,
            temperature=req.temperature, top_p=req.top_p, tool_choice=req.tool_choice or "auto", tools=tools,
            text={"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            user=req.user)

    def _keep(self, resp: ResponseObject, items: list[dict[str, Any]], parent: StoredResponse | None,
              store: bool | None) -> None:
        if store is not False:
            self.store.put(resp.id, StoredResponse(body=resp.model_dump(), items=items, parent=parent))

    async def _events(self, run: ServingRun, base: ResponseObject, items: list[dict[str, Any]],
                      parent: StoredResponse | None, store: bool | None, tool_index: list[int]) -> AsyncIterator[str]:
        assert run.chunks is not None
        events = ResponseEvents(base)
        try:
            for e in events.start():
                yield e
            async for chunk in run.chunks:
                for e in events.feed(chunk):
                    yield e
            closing, resp = events.finish()
            self._keep(resp, items, parent, store)  # stored before the last event: a client may continue at once
            for e in closing:
                yield e
        except ConnectionAbortedError:
            return  # the client left: its request is aborted (the response's group is cancelled)
        except Exception as e:  # noqa: BLE001  # after the 200 went out: reported in-band
            err = APIError.from_exception(e) or APIError(500, f"{type(e).__name__}: {e}", code="server_error")
            for event in events.fail(rename_error(err, tool_index)):
                yield event
        finally:
            await run.chunks.aclose()  # type: ignore[attr-defined]
