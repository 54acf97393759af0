"""ToolCallParser on its own: every format parses whole outputs, and streaming the same text in any
split gives the same content, calls and (joined) argument pieces."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.function_call.tool_parser import create_detector, detect_format

CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", '
               '"days": [1, {"n": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
               "Let me check."),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa\\"ris", "days": [1, {"n": 2}]}}; '
               '{"name": "add", "parameters": {"a": 1}}', ""),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, {"n": 2}]}}, '
                '{"name": "add", "arguments": {"a": 1}}]', ""),
}


def _check_calls(calls) -> None:
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": 'Pa"ris', "days": [1, {"n": 2}]}
    assert json.loads(calls[1].arguments) == {"a": 1}


def test_whole_outputs_parse() -> None:
    for fmt, (text, content) in CASES.items():
        got, calls = create_detector(fmt).parse(text)
        assert got == content, fmt
        _check_calls(calls)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.lists(st.integers(1, 12), min_size=1, max_size=80))
def test_streaming_in_any_split_matches(fmt, sizes) -> None:
    text, content = CASES[fmt]
    p = create_detector(fmt)
    out, args, names, pos, k = "", {}, {}, 0, 0
    while pos < len(text):
        piece = text[pos : pos + sizes[k % len(sizes)]]
        pos, k = pos + len(piece), k + 1
        c, deltas = p.feed(piece)
        out += c
        for d in deltas:
            if d.name is not None:
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    c, _ = p.finish()
    out += c
    assert out.strip() == content
    _check_calls(p.calls)
    assert [names[i] for i in sorted(names)] == ["get_weather", "add"]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in p.calls]


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    for text in ["a <tool_call> b", "<tool_call>not json</tool_call>", "x <tool_c", "{\"a\": 1}"]:
        got, calls = create_detector("hermes").parse(text)
        assert calls == [] and got == text
    got, calls = create_detector("hermes").parse('<tool_call>\n{"name": "f", "arguments": {"x": "cut')
    assert calls == []  # cut off by max_tokens: no call


def test_detect_format() -> None:
    assert detect_format(None) == "hermes"
    assert detect_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_format("<|python_tag|>{{ tools }}") == "llama3"


def test_structural_tag_shapes() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    p = create_detector("hermes")
    named = p.structural_tag(tools, "g", True)["format"]
    assert named["type"] == "tag" and named["begin"].endswith('"name": "g", "arguments": ')
    req = p.structural_tag(tools, None, False)["format"]
    assert req["type"] == "tags_with_separator" and req["at_least_one"] and req["stop_after_first"]
