"""The tool-call formats by name: the one list --tool-call-parser accepts, and `auto`'s choice.

`auto` reads the chat template for the markers each family's template writes; a template without
tool support gets the generic rendering (tool_prompt.py), which writes the hermes format, unless it is
Gemma's (no tool support of its own: Google's documented JSON prompt, gemma3).
"""

from __future__ import annotations

from typing import Any

from radixserve.function_call.base_detector import BaseDetector
from radixserve.function_call.gemma3_detector import Gemma3Detector
from radixserve.function_call.hermes_detector import HermesDetector
from radixserve.function_call.llama3_detector import Llama3Detector
from radixserve.function_call.mistral_detector import MistralDetector
from radixserve.function_call.pythonic_detector import PythonicDetector
from radixserve.function_call.qwen3_coder_detector import Qwen3CoderDetector

DETECTORS: dict[str, type[BaseDetector]] = {d.name: d for d in (
    HermesDetector, Llama3Detector, MistralDetector, Qwen3CoderDetector, PythonicDetector, Gemma3Detector)}
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", *DETECTORS)  # what ServerArgs.tool_call_parser accepts


def create_detector(name: str, tools: list[dict[str, Any]] | None = None) -> BaseDetector:
    if name not in DETECTORS:
        raise ValueError(f"tool_call_parser: unknown format {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return DETECTORS[name](tools)


def detect_format(chat_template: str | None) -> str:
    """The format a chat template implies (the first rule that matches)."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:  # Qwen3-Coder / Qwen3.5 (their templates also write <tool_call>)
        return "qwen3_coder"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "[func_name1(" in t or "<|python_start|>" in t:  # Llama 3.2 pythonic / Llama 4
        return "pythonic"
    if "<|python_tag|>" in t or ("tools" in t and '"parameters"' in t and "<tool_call>" not in t):
        return "llama3"
    if "<start_of_turn>" in t and "tools" not in t:  # Gemma 3: tool calls only through the prompt
        return "gemma3"
    return "hermes"
