"""Tools and tool messages -> what the chat template renders.

A template that knows tools (its source mentions `tools`) gets them as transformers passes them,
`apply_chat_template(messages, tools=...)`, and assistant `tool_calls` with their arguments as
objects (templates write `arguments | tojson`; OpenAI sends a JSON string, which would be encoded
twice). A template without
tool support gets the generic rendering in the server's tool-call format: the detector's own
instructions and call syntax, so what the model is taught is what the parser reads back. For hermes,
the default, that is Qwen's own template text, which any instruction-tuned model can follow:

    system:    <the client's system prompt>\n\n<the format's instructions, listing the tools>
    assistant: <content>\n<the calls in the format>   e.g. <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
    tool:      rendered as a user message <tool_response>\n<content>\n</tool_response>
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.function_call.base_detector import BaseDetector
from radixserve.function_call.hermes_detector import HermesDetector


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        native: bool, fmt: BaseDetector | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for a template with (`native`) or without tool
    support; `fmt` is the tool-call format the generic rendering teaches (hermes if None).
    `messages` are plain dicts with role / content / tool_calls / tool_call_id / name."""
    fmt = fmt or HermesDetector()
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**tc, "function": {**tc["function"], "arguments": _arguments_object(tc["function"].get("arguments"))}}
                    for tc in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    # a vision-language model's template reads content parts (serving_chat.template_content): text is added as a
    # part there, and a part list stays one
    parts = any(isinstance(m.get("content"), list) for m in messages)
    out = []
    for m in messages:
        role, content = m["role"], _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = fmt.render_calls([(tc["function"]["name"], _arguments_object(tc["function"].get("arguments")))
                                      for tc in m["tool_calls"]])
            content = "\n".join(([content] if content else []) + [calls])
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        else:
            content = m.get("content") or ""
        out.append({"role": role, "content": content})
    if tools:
        block = fmt.instructions(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": (first + [{"type": "text", "text": "\n\n" + block}]
                                                    if isinstance(first, list) else
                                                    f"{first}\n\n{block}" if first else block)}
        else:
            out.insert(0, {"role": "system", "content": block})
    if parts:
        out = [m if isinstance(m["content"], list) else {**m, "content": [{"type": "text", "text": m["content"]}]}
               for m in out]
    return out, {}


def _text(content: Any) -> str:
    """A message's text, from a string or content parts (image parts carry none)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""
