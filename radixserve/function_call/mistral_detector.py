"""mistral: Mistral / Mixtral instruct v3+ tool calling.

    [TOOL_CALLS] [{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.function_call.base_detector import tools_json_lines
from radixserve.function_call.json_detector import JsonDetector, JsonFormat

# Mistral's templates list tools in [AVAILABLE_TOOLS]; this is the same content as plain instructions
INSTRUCTIONS = (
    "You may call one or more of these functions to assist with the user query:\n{tools}\n\n"
    "To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls: "
    '[TOOL_CALLS] [{{"name": <function-name>, "arguments": <args-json-object>}}]'
)


class MistralDetector(JsonDetector):
    name = "mistral"
    fmt = JsonFormat((("[TOOL_CALLS]", True),), " \n\t[,", "]", "arguments",
                     '[TOOL_CALLS] [{{"name": "{name}", "arguments": ', "}]")

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=tools_json_lines(tools))

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
