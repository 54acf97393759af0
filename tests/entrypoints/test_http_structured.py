"""Structured output and tool calling over HTTP with the official openai client: response_format
(json_schema / json_object) on chat and completions, regex / EBNF extras, tool_choice required /
named / auto, streaming and not, a full tool round trip, and the 400s for bad constraints."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from radixserve.bench.grammar_schemas import PROMPTS, SCHEMAS
from tests.entrypoints.conftest import API_KEY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
       "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _valid_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("k", [4, 10, 16])  # an array, $refs, nested arrays (all 20: tests/constrained)
def test_response_format_json_schema_chat(sclient, k) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k], "strict": True}}
    for temperature in (0.0, 1.0):
        r = sclient.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPTS[k]}],
                                            response_format=fmt, temperature=temperature, seed=3, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[k])


def test_json_object_and_completions_constraints(sclient) -> None:
    # json_object bounds nothing (OpenAI: the output may be cut at max_tokens); a plain question ends
    ask = [{"role": "user", "content": "Write a JSON object with the keys name and age for Alice, who is 30."}]
    r = sclient.chat.completions.create(model="default", messages=ask, response_format={"type": "json_object"},
                                        temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = sclient.completions.create(model="smollm2-alias", prompt="A city as JSON:", max_tokens=120, temperature=0,
                                   extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "c", "schema": SCHEMAS[1]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[1])
    r = sclient.completions.create(model="smol", prompt="Call me at", max_tokens=30, temperature=1.0, seed=1,
                                   extra_body={"regex": r"\d{3}-\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", r.choices[0].text)
    r = sclient.completions.create(model="smol", prompt="Pick one:", max_tokens=10, temperature=1.0, seed=2,
                                   extra_body={"guided_choice": ["red (warm)", "blue"]})
    assert r.choices[0].text in ("red (warm)", "blue")
    stream = sclient.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Yes or no?"}], stream=True, max_tokens=20,
        extra_body={"ebnf": 'root ::= ("yes" | "no") "!"'})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes!", "no!")


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_always_validate(sclient, stream) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        for temperature in (0.0, 1.0):
            kw = dict(model="smol", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=temperature,
                      seed=5, max_tokens=200, parallel_tool_calls=False)
            if not stream:
                r = sclient.chat.completions.create(**kw)
                ch = r.choices[0]
                assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
                call = ch.message.tool_calls[0]
                _valid_call(call)
                if isinstance(choice, dict):
                    assert call.function.name == "add"
                continue
            calls: dict[int, dict] = {}
            reason = None
            for chunk in sclient.chat.completions.create(stream=True, **kw):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": None, "name": None, "args": "", "pieces": 0})
                    if tc.id:
                        c["id"], c["name"] = tc.id, tc.function.name
                    c["args"] += tc.function.arguments or ""
                    c["pieces"] += 1
                reason = chunk.choices[0].finish_reason or reason
            assert reason == "tool_calls" and list(calls) == [0]
            c = calls[0]
            assert c["id"].startswith("call_") and c["pieces"] > 2  # arguments arrive in pieces
            jsonschema.validate(json.loads(c["args"]), SCHEMA_OF[c["name"]])


def test_tool_round_trip_and_auto(sclient) -> None:
    first = sclient.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
    ]
    final = sclient.chat.completions.create(model="smol", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=60)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    msg = final.choices[0].message
    assert msg.content or msg.tool_calls
    for c in msg.tool_calls or []:
        _valid_call(c)
    none = sclient.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=20)
    assert none.choices[0].message.tool_calls is None


def test_the_chat_template_renders_tool_messages(structured_server) -> None:
    """The generic rendering (SmolLM2's template has no tool support): tools in the system prompt, calls
    and results as Hermes tags; the prompt is what the model sees (echoed by the usage count)."""
    from radixserve.entrypoints.openai_protocol import ChatMessage
    from radixserve.function_call.tool_prompt import render_for_template

    msgs = [ChatMessage(role="user", content="hi").model_dump(exclude_none=True),
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    out, extra = render_for_template(msgs, TOOLS, native=False)
    assert extra == {} and out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    native, extra = render_for_template(msgs, TOOLS, native=True)
    assert extra == {"tools": TOOLS} and native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"regex": "(unclosed"}, "regex", "invalid regular expression"),
    ({"ebnf": "root ::= nothing"}, "ebnf", "invalid EBNF"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "one constraint per request"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]}, "tools",
     "invalid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "128"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages", "takes no images"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages", "tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"json_schema": "x" * 100_001}, "json_schema", "characters"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
])
def test_bad_constraints_and_tools_are_400s_naming_the_field(structured_server, body, param, needle) -> None:
    payload = {"model": "smol", "messages": ASK, "max_tokens": 4, **body}
    r = httpx.post(structured_server.base_url + "/v1/chat/completions", json=payload,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    # and the server goes on answering
    ok = httpx.post(structured_server.base_url + "/v1/chat/completions", timeout=120,
                    json={"model": "smol", "messages": ASK, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_model_aliases_answer(sclient) -> None:
    names = [m.id for m in sclient.models.list().data]
    assert names == ["smol", "smollm2-alias"]  # 'default' answers too, but is not listed as a model of its own
    assert sclient.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        sclient.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
