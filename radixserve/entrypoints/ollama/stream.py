"""Ollama's streaming: newline-delimited JSON objects (application/x-ndjson), the last one `done: true`.

The objects are built from the same chunk objects /v1/chat/completions and /v1/completions stream
(ServingRun.chunks): text and thinking pieces as they come; tool calls whole, once the output ends (Ollama
sends each call complete, arguments as an object); then the final object with done_reason, the counts and
the durations. An error after the 200 headers went out is one last `{"error": "..."}` line, which Ollama's
clients raise; a client that left is sent nothing more, and its requests are aborted (their KV freed) by the
GroupStreamingResponse that carries the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.ollama.protocol import Logprob, ToolCall, ToolCallFunction
from radixserve.entrypoints.ollama.translate import Clock, arguments_object, done_reason
from radixserve.entrypoints.openai_serving import OPENAI_RENAMES, APIError, GroupStreamingResponse


class NDJSONResponse(GroupStreamingResponse):
    media_type = "application/x-ndjson"


def ndjson(obj: Any) -> str:
    payload = obj.model_dump_json(exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return payload + "\n"


@dataclass
class Piece:
    """What one chunk adds, in Ollama's terms."""

    content: str = ""
    thinking: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Any = None  # the closing chunk's UsageInfo


@dataclass
class Calls:
    """Streamed tool-call deltas (id and name first, then the arguments in pieces), put back together."""

    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, deltas: list[dict[str, Any]]) -> None:
        for d in deltas:
            call = self.calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = d.get("id") or call["id"]
            fn = d.get("function") or {}
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments") or ""

    def whole(self) -> list[ToolCall]:
        return [ToolCall(id=c["id"], function=ToolCallFunction(index=i, name=c["name"],
                                                                arguments=arguments_object(c["arguments"])))
                for i, c in sorted(self.calls.items())]


async def ndjson_stream(chunks: AsyncIterator[Any], read: Callable[[Any, Calls], Piece],
                        frame: Callable[..., Any], clock: Clock, renames: dict[str, str],
                        rename: Callable[[APIError, dict[str, str]], APIError]) -> AsyncIterator[str]:
    """The NDJSON lines of one streamed call. `read` turns a chunk into a Piece (collecting tool-call deltas);
    `frame(content=, thinking=, tool_calls=, logprobs=, done=, done_reason=, timings)` builds an object."""
    calls = Calls()
    reason: str | None = None
    usage: Any = None
    try:
        async for chunk in chunks:
            piece = read(chunk, calls)
            usage = piece.usage or usage
            reason = piece.finish_reason or reason
            if piece.content or piece.thinking or piece.logprobs:
                clock.mark_first()
                yield ndjson(frame(content=piece.content, thinking=piece.thinking or None,
                                   logprobs=piece.logprobs or None, done=False))
            elif calls.calls:
                clock.mark_first()
        if calls.calls:
            yield ndjson(frame(content="", tool_calls=calls.whole(), done=False))
        prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
        yield ndjson(frame(content="", done=True, done_reason=done_reason(reason),
                           **clock.timings(prompt, completion)))
    except ConnectionAbortedError:
        return
    except Exception as e:  # noqa: BLE001  # reported in-band: the 200 headers are gone
        err = APIError.from_exception(e, OPENAI_RENAMES) or APIError(500, f"{type(e).__name__}: {e}")
        yield json.dumps({"error": rename(err, renames).message}) + "\n"
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
