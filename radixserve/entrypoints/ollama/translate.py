"""Ollama shapes <-> the OpenAI request / response objects of the pipeline (serving_chat.py, serving_completions.py).

In: Ollama messages (tool calls with `arguments` as an object and no ids; tool results named by `tool_name`)
become OpenAI messages (ids assigned, each result paired with the first unanswered call of that name).
Out: OpenAI tool calls (arguments as JSON text) become Ollama's (an object), logprobs Ollama's list, finish
reasons Ollama's done_reason, and the scheduler's timings the final object's nanosecond durations.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from typing import Any

from radixserve.entrypoints.ollama.protocol import Logprob, Message, TokenLogprob, ToolCall, ToolCallFunction
from radixserve.entrypoints.openai_protocol import ChatLogprobs, CompletionLogprobs, ToolCallOut
from radixserve.entrypoints.openai_serving import APIError


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's chat history as OpenAI messages (see the module doc for the tool-call pairing)."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name), oldest first
    for k, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": with_images(m.content or "", m.images)}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages.{k}.tool_calls: only an assistant message makes tool calls",
                               "messages")
            d["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                call_id = call.id or f"call_{k}_{j}"
                d["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name, "arguments": json.dumps(call.function.arguments)}})
                unanswered.append((call_id, call.function.name))
        if m.role == "tool":
            match = next((u for u in unanswered if m.tool_name in (None, u[1])), None)
            if match is not None:
                unanswered.remove(match)
            # a result with no call before it (a client that ran the tool itself) still gets an id of its own
            d["tool_call_id"] = match[0] if match is not None else f"call_{k}"
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return out


def tool_calls(calls: list[ToolCallOut] | None) -> list[ToolCall] | None:
    """OpenAI tool calls -> Ollama's: `arguments` as an object (the parser checked it is JSON)."""
    if not calls:
        return None
    out = []
    for j, c in enumerate(calls):
        out.append(ToolCall(id=c.id, function=ToolCallFunction(index=j, name=c.function.name,
                                                                 arguments=arguments_object(c.function.arguments))))
    return out


def arguments_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        value = None
    # NOTE: the tool parsers return an object's JSON; anything else would be their bug, kept visible here
    return value if isinstance(value, dict) else {"arguments": text}


def chat_logprobs(lp: ChatLogprobs | None) -> list[Logprob] | None:
    if lp is None or lp.content is None:
        return None
    return [Logprob(token=t.token, logprob=t.logprob, bytes=t.bytes,
                    top_logprobs=[TokenLogprob(token=a.token, logprob=a.logprob, bytes=a.bytes)
                                  for a in t.top_logprobs])
            for t in lp.content]


def completion_logprobs(lp: CompletionLogprobs | None, top_k: int) -> list[Logprob] | None:
    if lp is None:
        return None
    out = []
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        alts = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_k]
        out.append(Logprob(token=token, logprob=logprob if logprob is not None else 0.0,
                           bytes=list(token.encode()),
                           top_logprobs=[TokenLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in alts]))
    return out


def done_reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason -> Ollama's done_reason: `length` when num_predict (or the context) ran out,
    else `stop` (an EOS, a stop string, or the end of a tool call, as Ollama reports them)."""
    return "length" if finish_reason == "length" else "stop"


class Clock:
    """One call's durations in nanoseconds, as Ollama reports them: total (the whole handler), prompt_eval
    (until the first output token), eval (the rest); load is 0 (the model is always loaded here)."""

    def __init__(self) -> None:
        self.start = time.perf_counter_ns()
        self.first: int | None = None  # when the first output arrived (streams)

    def mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def timings(self, prompt_tokens: int, completion_tokens: int, meta: dict[str, Any] | None = None
                ) -> dict[str, int]:
        now = time.perf_counter_ns()
        if meta is not None and "e2e_latency" in meta:  # non-streamed: the scheduler's own times
            e2e = int(meta["e2e_latency"] * 1e9)
            first = int(meta.get("ttft", meta["e2e_latency"]) * 1e9)
        else:
            e2e = now - self.start
            first = (self.first if self.first is not None else now) - self.start
        return {"total_duration": now - self.start, "load_duration": 0, "prompt_eval_count": prompt_tokens,
                "prompt_eval_duration": first, "eval_count": completion_tokens, "eval_duration": max(0, e2e - first)}


def renamed(e: APIError, renames: dict[str, str]) -> APIError:
    """The pipeline's error with the field it names spelled as the Ollama client sent it."""
    param = e.param
    if param is None or param not in renames:
        return e
    new, message = renames[param], e.message
    for old in [name for name, to in renames.items() if to == new]:  # max_tokens and max_new_tokens alike
        message = re.sub(rf"\b{re.escape(old)}\b", new, message, count=1)
    return APIError(e.status, message, new, e.code, e.headers)


def with_images(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    """Ollama's `images` (base64, no data: prefix) as the chat route's parts: the images, then the text, as
    Ollama's own templates place them. The chat route decodes them (the content decides the format), or refuses
    them for a text model."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b64}"}}
                                   for b64 in images]
    return [*parts, {"type": "text", "text": text}]
