"""Tools and tool messages -> what the chat template renders.

A template that knows tools (its source mentions `tools`) gets them as transformers passes them,
`apply_chat_template(messages, tools=...)`, and assistant `tool_calls` with their arguments as
objects (templates write `arguments | tojson`; OpenAI sends a JSON string, which would be encoded
twice). A template without tool support gets the generic rendering, Hermes-style like Qwen's own
template, which any instruction-tuned model can follow and the hermes parser reads back:

    system:    <the client's system prompt>\\n\\n# Tools ... <tools>{one JSON per tool}</tools> ...
               <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>
    assistant: <content>\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one per call)
    tool:      rendered as a user message <tool_response>\\n<content>\\n</tool_response>
"""

from __future__ import annotations

import json
from typing import Any

GENERIC_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


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
                        native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for a template with (`native`) or without tool
    support. `messages` are plain dicts with role / content / tool_calls / tool_call_id / name."""
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
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps({"name": tc["function"]["name"],
                                              "arguments": _arguments_object(tc["function"].get("arguments"))})
                + "\n</tool_call>"
                for tc in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        block = GENERIC_TOOLS_HEADER.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}
