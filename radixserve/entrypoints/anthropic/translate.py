"""Anthropic Messages <-> the chat pipeline's objects: a Messages request becomes a ChatCompletionRequest
(messages, tools, tool_choice, thinking), and the chat response comes back as a Message.

    system (string | text blocks)        -> a system message
    user: text / tool_result blocks      -> tool messages (one per result, in order), then the user's text
    assistant: text / tool_use blocks    -> an assistant message with tool_calls (thinking blocks dropped:
                                            the templates drop earlier reasoning, as the chat route does)
    tools [{name, description, input_schema}] -> function tools; tool_choice any -> "required"
    thinking enabled budget_tokens N     -> thinking_budget N; disabled -> chat_template_kwargs enable_thinking false

Every block is checked here, so an error names its place in the Anthropic request.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from radixserve.entrypoints.anthropic.protocol import AnthropicMessage, AnthropicUsage, _Prompt
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, ChatCompletionResponse, UsageInfo
from radixserve.entrypoints.openai_serving import APIError

# Anthropic features this server does not build: refused by name, never silently dropped
UNSUPPORTED = {
    "mcp_servers": "MCP connectors are not supported (run the tools on the client)",
    "container": "code-execution containers are not supported",
    "context_management": "server-side context management is not supported",
    "output_config": "output_config (effort, structured output format) is not supported",
    "output_format": "structured output formats are not supported",
}
_REFUSED_BLOCKS = {"document": "document blocks are not supported (send the text)"}
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # the chat route's rule for function names
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def bad(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", where.split(".")[0])


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "required" if value is None else f"must be a string, got {type(value).__name__}")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of content blocks, got {type(content).__name__}")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad(f"{where}.{j}", f"must be a content block (an object), got {type(block).__name__}")
    return content


def _block_type(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad(f"{where}.type", "required (a string)")
    if kind in _REFUSED_BLOCKS:
        raise bad(where, _REFUSED_BLOCKS[kind])
    return kind


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks (system, tool_result content) -> their text."""
    if content is None:
        return ""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if _block_type(block, f"{where}.{j}") != "text":
            raise bad(f"{where}.{j}.type", f"only text blocks are allowed here, got {block['type']!r}")
        parts.append(_string(block, "text", f"{where}.{j}"))
    return "".join(parts)  # joined as the chat route joins text parts


def _assistant(blocks: list[dict[str, Any]], where: str, ids: set[str]) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_use":
            call_id, name = _string(block, "id", at), _string(block, "name", at)
            if not isinstance(block.get("input"), dict):
                raise bad(f"{at}.input", "must be an object (the tool's arguments)")
            if call_id in ids:
                raise bad(f"{at}.id", f"tool_use id {call_id!r} is used twice")
            ids.add(call_id)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(block["input"])}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad(f"{at}.type", f"an assistant message holds text, tool_use or thinking blocks, got {kind!r}")
    return {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls or None}


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as the chat route's image_url part (the chat route decodes it, or refuses it for a text
    model): source base64 -> a data: URI, source url -> the URL."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{at}.source", "required (an object: base64 with media_type and data, or url)")
    if source.get("type") == "base64":
        media, data = _string(source, "media_type", f"{at}.source"), _string(source, "data", f"{at}.source")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": _string(source, "url", f"{at}.source")}}
    raise bad(f"{at}.source.type", f"must be base64 or url, got {source.get('type')!r}")


def _user(blocks: list[dict[str, Any]], where: str, ids: set[str]) -> list[dict[str, Any]]:
    texts, out = [], []
    images = False
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append({"type": "text", "text": _string(block, "text", at)})
        elif kind == "image":
            texts.append(_image_part(block, at))
            images = True
        elif kind == "tool_result":
            call_id = _string(block, "tool_use_id", at)
            if call_id not in ids:
                raise bad(f"{at}.tool_use_id", f"no earlier tool_use block has the id {call_id!r}")
            text = _texts(block.get("content"), f"{at}.content")
            if block.get("is_error") is True:  # the template has no error flag: the model reads it in the text
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise bad(f"{at}.type", f"a user message holds text, image or tool_result blocks, got {kind!r}")
    if texts or not out:  # parts only where an image is among them: a text model's template reads a string
        out.append({"role": "user", "content": texts if images else "".join(p["text"] for p in texts)})
    return out


def _tools(req: _Prompt) -> dict[str, Any]:
    """tools and tool_choice in the chat request's shape."""
    out: dict[str, Any] = {}
    names = []
    if req.tools:
        defs = []
        for k, tool in enumerate(req.tools):
            at = f"tools.{k}"
            if tool.get("type") not in (None, "custom"):
                raise bad(f"{at}.type", f"server tool {tool['type']!r} is not supported: only custom tools "
                                        "(name, description, input_schema)")
            name = _string(tool, "name", at)
            if not _TOOL_NAME.match(name):
                raise bad(f"{at}.name", f"must match {_TOOL_NAME.pattern}")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise bad(f"{at}.input_schema", "required (a JSON schema object)")
            desc = tool.get("description")
            if desc is not None and not isinstance(desc, str):
                raise bad(f"{at}.description", "must be a string")
            names.append(name)
            defs.append({"type": "function", "function": {"name": name, "description": desc, "parameters": schema}})
        out["tools"] = defs
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            name = _string(choice, "name", "tool_choice")
            if name not in names:
                raise bad("tool_choice.name", f"tool {name!r} is not in tools ({', '.join(names) or 'none given'})")
            out["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif kind in _CHOICES:
            if kind != "none" and not names:
                raise bad("tool_choice", f"{kind!r} requires tools")
            out["tool_choice"] = _CHOICES[kind]
        else:
            raise bad("tool_choice.type", "must be one of auto, any, tool, none")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
        if parallel:
            out["parallel_tool_calls"] = False
    return out


def _thinking(req: _Prompt, max_tokens: int | None) -> dict[str, Any]:
    cfg = req.thinking
    if cfg is None:
        return {}  # the server's default: the template's own (a model that thinks shows thinking blocks)
    kind = cfg.get("type")
    if cfg.get("display") not in (None, "summarized"):
        raise bad("thinking.display", "only 'summarized' (the thinking returned as it is) is supported")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {}  # the model decides: the template's default
    if kind != "enabled":
        raise bad("thinking.type", "must be one of enabled, disabled, adaptive")
    budget = cfg.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad("thinking.budget_tokens", f"must be a positive integer, got {budget!r}")
    if max_tokens is not None and budget >= max_tokens:  # Anthropic's rule: the thinking counts in max_tokens
        raise bad("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    return {"thinking_budget": budget}


def to_chat(req: _Prompt, **sampling: Any) -> ChatCompletionRequest:
    """The chat request the pipeline runs for `req`; `sampling` adds the chat fields (max_tokens, stop, ...)."""
    for name, why in UNSUPPORTED.items():
        if (req.model_extra or {}).get(name) is not None:
            raise bad(name, why)
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = _texts(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    ids: set[str] = set()
    for k, m in enumerate(req.messages):
        where = f"messages.{k}.content"
        blocks = _blocks(m.content, where)
        if m.role == "assistant":
            messages.append(_assistant(blocks, where, ids))
        else:
            messages.extend(_user(blocks, where, ids))
    if req.messages[-1].role == "assistant":
        raise bad(f"messages.{len(req.messages) - 1}", "a final assistant message (prefill) is not supported: "
                  "end with a user message")
    body = {"model": req.model, "messages": messages, **_tools(req),
            **_thinking(req, sampling.get("max_tokens")), **sampling}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # not expected: every part was checked above
        raise APIError.from_validation_error(e) from None


# chat error names -> the Anthropic field the client sent
_RENAMES = [(re.compile(r"^tools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
            (re.compile(r"^stop\b"), "stop_sequences"), (re.compile(r"^thinking_budget\b"), "thinking.budget_tokens"),
            (re.compile(r"^chat_template_kwargs\b"), "thinking"), (re.compile(r"^prompt\b"), "messages")]


def renamed(e: APIError) -> APIError:
    """A chat-pipeline error about a field, reworded with the Anthropic field's name."""
    message = e.message
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message, count=1)
    if message == e.message:
        return e
    return APIError(e.status, message, message.split(":")[0].split(".")[0], e.code, e.headers)


def stop_reason(finish: str | None, matched: Any, stops: list[str] | None, output_tokens: int,
                max_tokens: int) -> tuple[str, str | None]:
    """The chat finish_reason -> (Anthropic stop_reason, the stop sequence that matched)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":  # the context ran out before max_tokens did: Anthropic says so by name
        return ("max_tokens" if output_tokens >= max_tokens else "model_context_window_exceeded"), None
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def usage(u: UsageInfo | None) -> AnthropicUsage:
    if u is None:
        return AnthropicUsage(input_tokens=0, output_tokens=0)
    cached = u.prompt_tokens_details.cached_tokens
    return AnthropicUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                          cache_read_input_tokens=cached)


def tool_input(arguments: str) -> Any:
    """A call's arguments as the model wrote them: the JSON value (an object when a tool_choice forced the
    call, its schema's grammar guarantees it), or the text itself where the model wrote no JSON."""
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return arguments


def to_message(resp: ChatCompletionResponse, stops: list[str] | None, max_tokens: int) -> AnthropicMessage:
    choice = resp.choices[0]
    msg = choice.message
    content: list[dict[str, Any]] = []
    if msg.reasoning_content:
        content.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content:
        content.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls or []:
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                        "input": tool_input(call.function.arguments)})
    u = usage(resp.usage)
    reason, sequence = stop_reason(choice.finish_reason, choice.matched_stop, stops, u.output_tokens, max_tokens)
    return AnthropicMessage(id=resp.id, model=resp.model, content=content, stop_reason=reason,
                            stop_sequence=sequence, usage=u)
