"""Responses input -> chat messages: the items (a string, messages, function calls and their outputs,
reasoning) checked one by one, with errors naming `input.<k>.<field>`, then rendered as the chat route's
messages (system / user / assistant with tool_calls / tool), which its chat template turns into the prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from radixserve.entrypoints.openai_protocol import ChatMessage, FunctionCallIn, ToolCallIn
from radixserve.entrypoints.openai_serving import APIError
from radixserve.entrypoints.responses.protocol import INPUT_ITEMS

_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_file", "input_audio")


def _bad(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", "input")


def check_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as checked item dicts (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    items = []
    for k, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)  # an easy message has no type
        model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise _bad(f"input.{k}.type", f"{kind!r} is not supported (this server takes "
                       f"{', '.join(INPUT_ITEMS)} items)")
        try:
            checked = model.model_validate({**item, "type": kind})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
            raise _bad(f"input.{k}.{loc}" if loc else f"input.{k}", err["msg"]) from None
        items.append(checked.model_dump(exclude_none=True, by_alias=True))
    return items


def _text(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """A content string or its parts' text; with an input_image part, the chat route's parts (text and
    image_url, in order), which it decodes, or refuses for a text model. Files and audio are refused."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            raise _bad(f"{where}.{j}.type", f"{kind} is not supported (text and input_image parts)")
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(f"{where}.{j}.image_url", "required: a data: URI, or a URL or file the server allows "
                           "(file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind not in _TEXT_PARTS:
            raise _bad(f"{where}.{j}.type", f"{kind!r} is not supported (input_text, output_text or input_image)")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.{j}.text", "must be a string")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def to_messages(instructions: str | None, history: list[dict[str, Any]],
                items: list[dict[str, Any]]) -> list[ChatMessage]:
    """`instructions` as the system message, then the stored conversation (previous_response_id) and this
    request's items. Consecutive function calls join the assistant message before them (one turn, as the
    chat templates expect); a function_call_output must answer a call made earlier in the conversation."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    calls: set[str] = set()
    last_kind = None
    for k, item in enumerate(history + items):
        where = f"input.{k - len(history)}"  # stored items were checked when they were sent
        kind = item["type"]
        if kind == "message":
            messages.append(ChatMessage(role=item["role"], content=_text(item["content"], where + ".content")))
        elif kind == "function_call":
            call = ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=item["name"],
                                                                          arguments=item["arguments"]))
            prev = messages[-1] if messages else None
            if prev is not None and prev.role == "assistant" and last_kind in ("message", "function_call"):
                prev.tool_calls = [*(prev.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise _bad(f"{where}.call_id", f"no function_call earlier in the conversation has call_id "
                           f"{item['call_id']!r}")
            messages.append(ChatMessage(role="tool", content=_text(item["output"], where + ".output"),
                                        tool_call_id=item["call_id"]))
        # reasoning: an earlier turn's thinking is not put back into the prompt (the thinking models'
        # templates drop it from past turns); it is accepted so that clients can send their items back
        if kind != "reasoning":
            last_kind = kind
    if not messages:
        raise _bad("input", "is empty (give a string or at least one message)")
    return messages
