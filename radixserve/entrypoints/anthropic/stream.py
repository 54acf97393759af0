"""The chat pipeline's stream chunks -> Anthropic's server-sent events, in the documented order:

    message_start (usage: the prompt's input_tokens), ping
    content_block_start / content_block_delta ... / content_block_stop      one block at a time:
        thinking  (thinking_delta, then signature_delta "" before it stops)  from the reasoning deltas
        text      (text_delta)                                               from content deltas
        tool_use  (input_json_delta)                                         one per tool call
    message_delta (stop_reason, stop_sequence, usage), message_stop

An error after the 200 went out is an `event: error` with Anthropic's error body, and ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from radixserve.entrypoints.anthropic import translate
from radixserve.entrypoints.openai_protocol import ChatCompletionChunk, UsageInfo
from radixserve.entrypoints.openai_serving import APIError, GroupStreamingResponse, RequestGroup


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error object for an APIError's status."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error"}.get(err.status)
    if kind is None:
        kind = "invalid_request_error" if err.status < 500 and err.status != 409 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicSSE(GroupStreamingResponse):
    media_type = "text/event-stream"


class EventWriter:
    """Turns one streamed chat choice into Anthropic events; one content block is open at a time."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int, stops: list[str] | None,
                 max_tokens: int) -> None:
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens
        self.stops, self.max_tokens = stops, max_tokens
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # its type, None when closed
        self.finish: str | None = None
        self.matched: Any = None
        self.usage: UsageInfo | None = None

    def start(self) -> list[str]:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event("message_start", {"message": message}), event("ping", {})]

    def _close(self) -> list[str]:
        out = []
        if self.open == "thinking":  # Anthropic signs a thinking block before it stops; nothing to sign here
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        if self.open is not None:
            out.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        out = [] if self.open == kind else self._open(kind, _EMPTY[kind]())
        out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def feed(self, chunk: ChatCompletionChunk) -> list[str]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        out: list[str] = []
        for choice in chunk.choices:  # one: Anthropic has no n
            delta = choice.delta
            if thought := delta.get("reasoning_content"):
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": thought})
            if text := delta.get("content"):
                out += self._delta("text", {"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") is not None:  # a new call opens its own block
                    out += self._open("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name"),
                                                   "input": {}})
                if fn.get("arguments"):
                    out.append(event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}))
            if choice.finish_reason is not None:
                self.finish, self.matched = choice.finish_reason, choice.matched_stop
        return out

    def end(self) -> list[str]:
        usage = translate.usage(self.usage)
        reason, sequence = translate.stop_reason(self.finish, self.matched, self.stops, usage.output_tokens,
                                                 self.max_tokens)
        return [*self._close(),
                event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": usage.model_dump()}),
                event("message_stop", {})]


_EMPTY = {"thinking": lambda: {"type": "thinking", "thinking": "", "signature": ""},
          "text": lambda: {"type": "text", "text": ""}}


async def events(writer: EventWriter, chunks: AsyncIterator[ChatCompletionChunk],
                 group: RequestGroup) -> AsyncIterator[str]:
    """The whole stream; a client that left (ConnectionAbortedError) is sent nothing more, and the group is
    cancelled however the stream ends (its requests aborted, their KV freed)."""
    try:
        for e in writer.start():
            yield e
        async for chunk in chunks:
            for e in writer.feed(chunk):
                yield e
        for e in writer.end():
            yield e
    except ConnectionAbortedError:
        return
    except Exception as e:  # noqa: BLE001  # after the 200: reported in-band, as Anthropic's API does
        err = APIError.from_exception(e) or APIError(500, f"internal error: {type(e).__name__}: {e}")
        yield f"event: error\ndata: {json.dumps(error_body(translate.renamed(err)))}\n\n"
    finally:
        group.cancel()
        await chunks.aclose()  # type: ignore[attr-defined]
