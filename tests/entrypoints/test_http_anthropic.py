"""Anthropic Messages (/v1/messages, /v1/messages/count_tokens) driven by the official `anthropic` SDK and
LangChain's ChatAnthropic against the real servers: a plain and a streamed answer equal the chat route's
greedy text, token counts agree with /tokenize and the chat route's prompt_tokens, a forced tool call
round-trips through tool_use / tool_result blocks, thinking comes back as thinking blocks under its
budget, errors are Anthropic's shape (each bad request followed by one that succeeds), and a stream the
client leaves is aborted (its KV freed)."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
from langchain_anthropic import ChatAnthropic
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_http_structured import ASK as WEATHER_ASK
from tests.entrypoints.test_http_structured import SCHEMA_OF, TOOLS

SYSTEM = "You are a helpful assistant. Answer in one sentence."
ASK = [{"role": "user", "content": "Name a colour of the sky."}]
GREEDY = {"temperature": 0}  # the SDK no longer takes sampling arguments; the API still does
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
HEADERS = {"x-api-key": API_KEY}  # Anthropic's clients send the key so


def _sdk(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def _openai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def _blocks(msg) -> list[tuple]:
    return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "signature", None))
            for b in msg.content]


def _raw_events(srv, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; every `event:` line names its data's type."""
    out, name = [], None
    with httpx.stream("POST", srv.base_url + "/v1/messages", json={**body, "stream": True}, headers=HEADERS,
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


def test_an_answer_equals_the_chat_routes_and_the_counts_agree(server, http) -> None:
    sdk, chat_msgs = _sdk(server), [{"role": "system", "content": SYSTEM}, *ASK]
    chat = _openai(server).chat.completions.create(model="default", messages=chat_msgs, max_tokens=16, temperature=0)
    msg = sdk.messages.create(model="default", max_tokens=16, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    # Anthropic's usage: the prompt is input_tokens + cache_read_input_tokens (the chat call just cached it)
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens and u.cache_read_input_tokens > 0
    assert u.output_tokens == chat.usage.completion_tokens and u.cache_creation_input_tokens == 0
    counted = sdk.messages.count_tokens(model="default", system=SYSTEM, messages=ASK).input_tokens
    assert counted == http.post("/tokenize", json={"messages": chat_msgs}).json()["count"] == chat.usage.prompt_tokens
    # system and content as text blocks, through the beta client (?beta=true): the same answer
    blocks = [{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}]
    beta = sdk.beta.messages.create(model="default", max_tokens=16, system=[{"type": "text", "text": SYSTEM}],
                                    messages=blocks, extra_body=GREEDY)
    assert _text(beta) == _text(msg)
    assert httpx.head(server.base_url + "/").status_code == 200  # the probe Anthropic-speaking agents send


def test_a_stream_is_the_same_answer_in_anthropics_event_order(server) -> None:
    kw = {"model": "default", "max_tokens": 16, "system": SYSTEM, "messages": ASK}
    whole = _sdk(server).messages.create(**kw, extra_body=GREEDY)
    with _sdk(server).messages.stream(**kw, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    names = [n for n, _ in _raw_events(server, {**kw, **GREEDY})]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[3:-3]) == {"content_block_delta"}


def test_stop_sequences_end_the_answer_and_are_named(server) -> None:
    kw = {"model": "default", "max_tokens": 16, "system": SYSTEM, "messages": ASK, "extra_body": GREEDY}
    text = _text(_sdk(server).messages.create(**kw))
    stop = text.split()[2]
    expected = text[:text.index(stop)]
    assert expected.strip(), text
    msg = _sdk(server).messages.create(**kw, stop_sequences=["NEVER-SEEN", stop])
    assert (_text(msg), msg.stop_reason, msg.stop_sequence) == (expected, "stop_sequence", stop)
    with _sdk(server).messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (_text(final), final.stop_reason, final.stop_sequence) == (expected, "stop_sequence", stop)


def test_a_forced_tool_call_round_trips_as_the_chat_routes(structured_server) -> None:
    sdk, oai = _sdk(structured_server), _openai(structured_server)
    first = sdk.messages.create(model="smol", max_tokens=200, messages=WEATHER_ASK, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1, first.content
    use = uses[0]
    jsonschema.validate(use.input, SCHEMA_OF[use.name])
    chat = oai.chat.completions.create(model="smol", messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=200)
    call = chat.choices[0].message.tool_calls[0]
    assert (use.name, use.input) == (call.function.name, json.loads(call.function.arguments))
    # the result goes back as a tool_result block; the chat route given the same history answers the same
    result = json.dumps({"temperature_c": 21, "sky": "sunny"})
    history = [*WEATHER_ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    second = sdk.messages.create(model="smol", max_tokens=16, messages=history, tools=ANTHROPIC_TOOLS,
                                 extra_body=GREEDY)
    chat_history = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}]
    chat2 = oai.chat.completions.create(model="smol", messages=chat_history, tools=TOOLS, temperature=0, max_tokens=16)
    assert _text(second) == (chat2.choices[0].message.content or "")
    assert [b.name for b in second.content if b.type == "tool_use"] == \
        [c.function.name for c in chat2.choices[0].message.tool_calls or []]
    u = second.usage
    assert sdk.messages.count_tokens(model="smol", messages=history, tools=ANTHROPIC_TOOLS).input_tokens == \
        u.input_tokens + u.cache_read_input_tokens == chat2.usage.prompt_tokens
    # a named tool, streamed: one tool_use block whose input arrives as input_json_delta pieces
    named = {"model": "smol", "max_tokens": 200, "messages": WEATHER_ASK, "tools": ANTHROPIC_TOOLS, "extra_body": GREEDY,
             "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True}}
    with sdk.messages.stream(**named) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert [(b.type, b.name) for b in final.content] == [("tool_use", "add")] and final.stop_reason == "tool_use"
    assert len(kinds) > 1 and set(kinds) == {"input_json_delta"}
    jsonschema.validate(final.content[0].input, SCHEMA_OF["add"])
    # tool_choice none: the tools are not offered, no call comes back
    none = sdk.messages.create(model="smol", max_tokens=8, messages=WEATHER_ASK, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert none.stop_reason != "tool_use" and all(b.type == "text" for b in none.content)


def test_thinking_comes_back_as_thinking_blocks_under_its_budget(reasoning_server) -> None:
    sdk, oai, n = _sdk(reasoning_server), _openai(reasoning_server), 8
    kw = {"model": "smol", "max_tokens": 48, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": n},
          "extra_body": GREEDY}
    msg = sdk.messages.create(**kw)
    chat = oai.chat.completions.create(model="smol", messages=ASK, max_tokens=48, temperature=0,
                                       extra_body={"thinking_budget": n})
    thought = (chat.choices[0].message.model_extra or {})["reasoning_content"]
    assert thought and msg.content[0].type == "thinking"
    assert (msg.content[0].thinking, msg.content[0].signature) == (thought, "")
    assert _text(msg) == (chat.choices[0].message.content or "")
    assert chat.usage.completion_tokens_details.reasoning_tokens <= n + 8  # closed by the budget, not max_tokens
    with sdk.messages.stream(**kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert _blocks(final) == _blocks(msg)
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds
    # disabled: the template closes the thinking; no thinking block, the chat route's enable_thinking false
    off = sdk.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    chat_off = oai.chat.completions.create(model="smol", messages=ASK, max_tokens=48, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert all(b.type == "text" for b in off.content) and _text(off) == (chat_off.choices[0].message.content or "")
    # Anthropic's rule: the budget is part of max_tokens
    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens"):
        sdk.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 48}})
    assert _blocks(sdk.messages.create(**kw)) == _blocks(msg)


def test_langchain_chat_anthropic_gets_the_chat_routes_answer(server) -> None:
    chat = _openai(server).chat.completions.create(model="default", max_tokens=16, temperature=0,
                                                   messages=[{"role": "system", "content": SYSTEM}, *ASK])
    model = ChatAnthropic(model="default", base_url=server.base_url, api_key=API_KEY, max_tokens=16, temperature=0,
                          max_retries=0)
    reply = model.invoke([("system", SYSTEM), ("human", ASK[0]["content"])])
    assert reply.content == chat.choices[0].message.content
    assert reply.usage_metadata["input_tokens"] == chat.usage.prompt_tokens  # LangChain adds the cache reads back


GOOD = {"model": "default", "max_tokens": 2, "messages": ASK}
TOOL_HISTORY = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "5"}]}]
BAD = [  # (body, status, Anthropic error type, what the message names)
    ({"model": "default", "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({**GOOD, "messages": TOOL_HISTORY}, 400, "invalid_request_error", "toolu_nowhere"),
    ({**GOOD, "max_tokens": 10**9}, 400, "invalid_request_error", "max_tokens"),
    ({**GOOD, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({**GOOD, "max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
    ({**GOOD, "messages": "hi"}, 400, "invalid_request_error", "messages"),
    ({**GOOD, "messages": [{"role": "user", "content": [1]}]}, 400, "invalid_request_error", "messages.0.content.0"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.source.type"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, 400,
     "invalid_request_error", "this model takes no images"),
    ({**GOOD, "messages": [*ASK, {"role": "assistant", "content": "The"}]}, 400, "invalid_request_error", "prefill"),
    ({**GOOD, "messages": [{"role": "user", "content": "x" * 5_000_000}]}, 400, "invalid_request_error", "messages"),
    ({**GOOD, "temperature": 7}, 400, "invalid_request_error", "temperature"),
    ({**GOOD, "stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
    ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 1}}, 400, "invalid_request_error", "thinking"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "tools.0.type"),
    ({**GOOD, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "tool_choice.name"),
    ({**GOOD, "mcp_servers": [{"type": "url", "url": "http://x"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({**GOOD, "model": "claude-opus-4"}, 404, "not_found_error", "claude-opus-4"),
]


@pytest.mark.parametrize(("body", "status", "kind", "needle"), BAD, ids=range(len(BAD)))
def test_bad_input_is_anthropics_error_and_the_next_request_succeeds(server, body, status, kind, needle) -> None:
    r = httpx.post(server.base_url + "/v1/messages", json=body, headers=HEADERS, timeout=300)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and needle in err["error"]["message"], err
    ok = httpx.post(server.base_url + "/v1/messages", json=GOOD, headers=HEADERS, timeout=300)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1, ok.text


def test_the_gate_and_the_count_route_answer_in_anthropics_shape(server) -> None:
    sdk = _sdk(server)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(**GOOD)
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        sdk.messages.count_tokens(model="default", messages=[])
    r = httpx.post(server.base_url + "/v1/messages", content=b"{not json", headers={**HEADERS,
                   "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert sdk.messages.create(**GOOD).usage.output_tokens >= 1


def _aborted(srv) -> float:
    text = httpx.get(srv.base_url + "/metrics", headers=HEADERS).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "radixserve:num_requests_total" and s.labels.get("finish_reason") == "abort")


def test_a_stream_the_client_leaves_is_aborted(server, http) -> None:
    # greedy, this answer runs past 160 tokens (it ends at max_tokens): still decoding when the client leaves,
    # so its end is an abort, counted in /metrics (a request that finished would not count)
    body = {"model": "default", "max_tokens": 160, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]}
    before = _aborted(server)
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, headers=HEADERS,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                break  # hang up after the first token
    deadline = time.monotonic() + 60
    while True:
        info = http.get("/get_server_info").json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_used_tokens"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert _aborted(server) == before + 1
    assert _sdk(server).messages.create(**GOOD).usage.output_tokens >= 1


def test_an_error_after_the_headers_is_an_error_event(server, http) -> None:
    """A request aborted mid-stream (POST /abort_request with the message id, its rid) ends the stream with
    `event: error`, which the SDK raises."""
    body = {"model": "default", "max_tokens": 160, "extra_body": GREEDY,
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]}
    with pytest.raises(anthropic.APIStatusError, match="aborted") as caught, \
            _sdk(server).messages.stream(**body) as s:
        aborted = False
        for e in s:  # read on after the abort: the error event ends the stream
            if e.type == "content_block_delta" and not aborted:
                assert http.post("/abort_request", json={"rid": s.current_message_snapshot.id}).json()["success"]
                aborted = True
    assert caught.value.body["error"]["type"] == "api_error"
    assert _sdk(server).messages.create(**GOOD).usage.output_tokens >= 1


def test_a_bad_input_schema_is_refused_by_messages_and_count_tokens_alike(server) -> None:
    """count_tokens renders through the chat route's own check of each tool's schema (OpenAIServingChat.render),
    so a schema /v1/messages refuses is refused there too, naming the tool's input_schema, not counted."""
    bad_tool = [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {"a": {"type": 5}}}}]
    body = {"model": "default", "messages": ASK, "tools": bad_tool}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(server.base_url + path, json={**body, **extra}, headers=HEADERS, timeout=300)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and "tools.0.input_schema" in r.text, r.text
    ok = httpx.post(server.base_url + "/v1/messages/count_tokens", json={"model": "default", "messages": ASK},
                    headers=HEADERS, timeout=300)
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
