"""Every tool-call format (registry.DETECTORS): whole outputs parse; any split of the same text into
random deltas gives the same content, calls and (joined) argument pieces; malformed calls never raise
and end as the module docstrings say; the structural tag accepts what the format writes and the
parser reads it back; the generic prompt teaches each format."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from radixserve.function_call.registry import DETECTORS, TOOL_CALL_PARSERS, create_detector, detect_format
from radixserve.function_call.tool_prompt import render_for_template

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}},
                                            "n": {"type": "integer"}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
W_ARGS = {"city": 'Pa"ris, <b>(x)', "days": [1, {"n": 2}]}
# a text per format: content around two calls, the second after the first
CASES = {
    "hermes": (('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris, <b>(x)", '
               '"days": [1, {"n": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'),
               "Let me check."),
    "llama3": (('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa\\"ris, <b>(x)", "days": [1, {"n": 2}]}}; '
               '{"name": "add", "parameters": {"a": 1}}'), ""),
    "mistral": (('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa\\"ris, <b>(x)", "days": [1, {"n": 2}]}}, '
                '{"name": "add", "arguments": {"a": 1}}]'), ""),
    "gemma3": (('{"name": "get_weather", "parameters": {"city": "Pa\\"ris, <b>(x)", "days": [1, {"n": 2}]}}\n'
               '{"name": "add", "parameters": {"a": 1}}'), ""),
    "qwen3_coder": (("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\"ris, <b>(x)\n"
                    "</parameter>\n<parameter=days>\n[1, {\"n\": 2}]\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
                    "I will look it up."),
    "pythonic": ("Sure: [get_weather(city='Pa\"ris, <b>(x)', days=[1, {'n': 2}]), add(a=1)] done", "Sure:  done"),
}


def _check(calls) -> None:
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == W_ARGS
    assert json.loads(calls[1].arguments) == {"a": 1}


def test_every_format_has_a_case_and_the_names_are_one_list() -> None:
    assert set(CASES) == set(DETECTORS) and TOOL_CALL_PARSERS == ("auto", *DETECTORS)
    with pytest.raises(ValueError, match="known: auto, hermes"):
        create_detector("gpt-oss")


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_whole_output_parses(fmt) -> None:
    text, content = CASES[fmt]
    got, calls = create_detector(fmt, TOOLS).parse(text)
    assert got == content
    _check(calls)


def _stream(fmt: str, text: str, sizes: list[int], tools=TOOLS):
    p = create_detector(fmt, tools)
    out, args, names, pos, k = "", {}, {}, 0, 0
    while pos < len(text):
        piece = text[pos : pos + sizes[k % len(sizes)]]
        pos, k = pos + len(piece), k + 1
        c, deltas = p.feed(piece)
        out += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in names  # a call opens once
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    c, _ = p.finish()
    return p, out + c, names, args


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.lists(st.integers(1, 12), min_size=1, max_size=80))
def test_streaming_in_any_split_matches_the_whole(fmt, sizes) -> None:
    text, content = CASES[fmt]
    p, out, names, args = _stream(fmt, text, sizes)
    assert out.strip() == content.strip()
    _check(p.calls)
    assert [names[i] for i in sorted(names)] == ["get_weather", "add"]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in p.calls]


MALFORMED = {  # text -> (names of the calls kept, content)
    "qwen3_coder": [
        ("a <tool_call> b", [], "a <tool_call> b"),  # no <function=: content
        ("<tool_call>\n<function=add>\n<parameter=a>\n1", [], ""),  # cut off: dropped
        ("<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", [], ""),
        ("<tool_call>\n<function=add>\nstray\n</function>\n</tool_call>", [], "stray\n</function>\n</tool_call>"),
        ("<tool_call>\n<function=bad name!>\n</function>", [], "<tool_call>\n<function=bad name!>\n</function>"),
        ("x <tool_call" + "\n" * 3, [], "x <tool_call\n\n\n"),
    ],
    "pythonic": [
        ("[1, 2] and [note]", [], "[1, 2] and [note]"),
        ("[add(a=x)]", [], ""),  # a name, not a literal: the call is dropped
        ("[add(1)]", [], ""),  # positional
        ("[add(a=__import__('os').system('true'))]", [], ""),  # never evaluated
        ("[add(a=1+)]", [], ""),
        ("[add(a=1, a=2), add(a=3)]", ["add"], ""),  # a repeated keyword drops that call only
        ("[nope(a=1), add(a=2)]", ["add"], ""),  # unknown function: dropped
        ("[add(a='unclosed)]", [], ""),  # cut off inside a string
        ("[add(a=1)] tail", ["add"], "tail"),
        ("[add(a=1) oops", ["add"], "oops"),
        ("[" + "a" * 300, [], "[" + "a" * 300),
    ],
    "gemma3": [  # found by test_random_text_never_raises: arguments that are not JSON are never a call
        ('{"name": "add", "parameters"::::}', [], '{"name": "add", "parameters"::::}'),
        ('{"name": "add", "parameters": 5}', [], '{"name": "add", "parameters": 5}'),
        ('{"name": "add", "parameters": [}', [], ""),  # closes but does not match: dropped like a cut-off call
        ('{"name": "a\\q", "parameters": {}}', [], '{"name": "a\\q", "parameters": {}}'),  # not a JSON escape
        ('{"name": "add", "parameters": 5} {"name": "add", "parameters": {"a": 1}}', ["add"],
         '{"name": "add", "parameters": 5}'),  # the text after a head that is not a call is read on
    ],
    "hermes": [
        ('<tool_call>\n{"name": "nope", "arguments": {"a": 1}}\n</tool_call>', [], ""),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1', [], ""),
    ],
}


@pytest.mark.parametrize("fmt, text, names, content", [(f, *c) for f, cases in MALFORMED.items() for c in cases])
def test_malformed_calls_never_raise(fmt, text, names, content) -> None:
    got, calls = create_detector(fmt, TOOLS).parse(text)
    assert [c.name for c in calls] == names and got == content.strip() if names else got == content
    for sizes in ([1], [2, 5], [7]):  # streamed the same way
        p, out, _, _ = _stream(fmt, text, sizes)
        assert [c.name for c in p.calls] == names
        assert out.strip() == got.strip()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.text(alphabet='<>[](){}=,"\'\\ \nabcdfnu_:/|', max_size=80))
def test_random_text_never_raises(fmt, junk) -> None:
    text = CASES[fmt][0]
    for t in (junk, text[: len(junk)] + junk, junk + text):
        _content, calls = create_detector(fmt, TOOLS).parse(t)
        for c in calls:
            json.loads(c.arguments)  # whatever is returned as a call is JSON


def test_qwen3_coder_converts_by_schema_type() -> None:
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "f": {"type": "number"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "l": {"type": ["array", "null"]}, "e": {"enum": ["x", "y"]}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in [
        ("s", "007"), ("i", "42"), ("f", "2.5"), ("b", "True"), ("o", "{'k': [1, None]}"), ("l", "null"),
        ("e", "x"), ("i2", "3"), ("u", "notanumber")])
    _, calls = create_detector("qwen3_coder", tools).parse(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"s": "007", "i": 42, "f": 2.5, "b": True, "o": {"k": [1, None]},
                                              "l": None, "e": "x", "i2": "3", "u": "notanumber"}
    _, calls = create_detector("qwen3_coder", tools).parse("<tool_call>\n<function=f>\n<parameter=i>\nabc\n</parameter>\n"
                                                            "</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"i": "abc"}  # does not convert: stays text


SCHEMA_CALLS = [("get_weather", {"city": "Paris (FR)", "days": [1, 2], "n": -3}), ("add", {"a": 7})]


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_structural_tag_accepts_the_rendered_calls_and_they_parse_back(fmt) -> None:
    det = create_detector(fmt, TOOLS)
    for name, args in SCHEMA_CALLS:  # named: exactly this call
        tag = det.structural_tag(TOOLS, name, parallel=True)
        grammar = xgr.Grammar.from_structural_tag(tag)
        text = det.render_calls([(name, args)])
        assert _is_grammar_accept_string(grammar, text), text
        other = dict(SCHEMA_CALLS)["add" if name == "get_weather" else "get_weather"]
        assert not _is_grammar_accept_string(grammar, det.render_calls([(name, other)]))
        _, calls = create_detector(fmt, TOOLS).parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
    tag = det.structural_tag(TOOLS, None, parallel=False)  # required: one call of any tool
    assert tag["format"]["type"] in ("tags_with_separator", "sequence")
    assert _is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), det.render_calls(SCHEMA_CALLS[1:]))
    assert not _is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), "plain text")


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_generic_prompt_teaches_the_format(fmt) -> None:
    det = create_detector(fmt)
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    out, extra = render_for_template(msgs, TOOLS, native=False, fmt=det)
    assert extra == {} and out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    marker = {"hermes": "<tool_call>", "llama3": '"parameters"', "mistral": "[TOOL_CALLS]", "gemma3": '"parameters"',
              "qwen3_coder": "<parameter=", "pythonic": "[func_name1("}[fmt]
    assert marker in out[0]["content"]
    _, calls = create_detector(fmt, TOOLS).parse(out[2]["content"])  # the history call reads back
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]


def test_auto_detection() -> None:
    assert detect_format(None) == "hermes"
    assert detect_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format("{{ tools }}<tool_call>\n<function=example_function_name>\n<parameter=x>") == "qwen3_coder"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_format("<|python_tag|>{{ tools }}") == "llama3"
    assert detect_format("{{ tools }} [func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_format("<|header_start|>{{ tools }}<|python_start|>") == "pythonic"
    assert detect_format("<start_of_turn>user\n{{ message }}") == "gemma3"
