"""The tool-call parser's public names, for serving_chat.py and tests; one file per format holds each.

    ToolCallParser.create(name, tools)   a fresh detector (streaming state) for one output
    detect_format(chat_template)         what --tool-call-parser auto picks
    TOOL_CALL_PARSERS                    every accepted name
"""

from __future__ import annotations

from radixserve.function_call.base_detector import BaseDetector as ToolCallParser
from radixserve.function_call.base_detector import ToolCall, ToolCallDelta
from radixserve.function_call.registry import TOOL_CALL_PARSERS, create_detector, detect_format

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallParser", "create_detector", "detect_format"]
