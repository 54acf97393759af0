"""llama3: Llama 3.1 / 3.2 / 3.3 JSON tool calling.

    <|python_tag|>{"name": "f", "parameters": {...}}      or the bare JSON; calls separated by ';'
"""

from __future__ import annotations

from typing import Any

from radixserve.function_call.base_detector import tools_json_lines
from radixserve.function_call.json_detector import JsonDetector, JsonFormat

# Llama 3.1's own template text (the JSON-based tool calling of its model card)
INSTRUCTIONS = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)


class Llama3Detector(JsonDetector):
    name = "llama3"
    fmt = JsonFormat((("<|python_tag|>", True), ('{"name"', False)), " \n\t;", "", "parameters",
                     '{{"name": "{name}", "parameters": ', "}")

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=tools_json_lines(tools))
