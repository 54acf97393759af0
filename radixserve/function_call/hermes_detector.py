"""hermes: Qwen 2.5 / Qwen3, Hermes, and radixserve's generic rendering for templates without tools.

    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     one block per call
"""

from __future__ import annotations

from typing import Any

from radixserve.function_call.base_detector import tools_json_lines
from radixserve.function_call.json_detector import JsonDetector, JsonFormat

# Qwen's own template text, so a Qwen-family model sees what it was trained on
INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class HermesDetector(JsonDetector):
    name = "hermes"
    fmt = JsonFormat((("<tool_call>", True),), " \n\t", "</tool_call>", "arguments",
                     '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>")

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=tools_json_lines(tools))
