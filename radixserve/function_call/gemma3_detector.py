"""gemma3: Gemma 3's prompt-based JSON function calling.

Gemma 3 has no tool tokens and its template no tool support; Google's function-calling guide
(ai.google.dev/gemma/docs/capabilities/function-calling) gives two prompts. This is the JSON one:

    {"name": "f", "parameters": {...}}              the whole reply, no other text

(the guide's other prompt, `[f(a=1)]`, is the `pythonic` parser). The instructions below are the
guide's text followed by the function definitions as a JSON list, as the guide lays them out.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.function_call.json_detector import JsonDetector, JsonFormat

INSTRUCTIONS = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
    'format of\n{{"name": function name, "parameters": dictionary of argument name and its value}}\n\n'
    "You SHOULD NOT include any other text in the response if you call a function\n{tools}"
)


def gemma_function_list(tools: list[dict[str, Any]]) -> str:
    return json.dumps([t.get("function", t) for t in tools], indent=2)


class Gemma3Detector(JsonDetector):
    name = "gemma3"
    fmt = JsonFormat((('{"name"', False),), " \n\t;,", "", "parameters", '{{"name": "{name}", "parameters": ', "}")

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=gemma_function_list(tools))
