"""OpenAI's Responses API (/v1/responses) against real servers, driven by the official openai client: plain and
streamed (the documented event order, sequence numbers, the SDK's own stream accumulator), equal to
/v1/chat/completions' greedy answer with token counts equal to /tokenize's; a function-call round trip through
previous_response_id and function_call_output (the call forced, so it always comes); text.format json_schema;
reasoning items and reasoning.effort's budget on the reasoning server; GET / DELETE of stored responses and the
store's LRU cap; bad input (each a 4xx naming the field, then a request that succeeds); a client that hangs up
mid-stream (aborted, KV freed) and an abort mid-stream (error + response.failed events)."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from radixserve.entrypoints.responses.store import ResponseStore, StoredResponse
from radixserve.parser.reasoning_parser import THINK_END
from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_http_structured import ADD, WEATHER

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
               "parameters": WEATHER},
              {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in FLAT_TOOLS]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def srv(structured_server):
    return structured_server


@pytest.fixture(scope="module")
def oc(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def web(srv):
    with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=300) as c:
        yield c


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _collapse(types: list[str]) -> list[str]:
    """Runs of the same delta event as one entry, to compare against the documented order."""
    return [t for k, t in enumerate(types) if not (t.endswith(".delta") and k and types[k - 1] == t)]


def _wait_idle(web: httpx.Client, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = web.get("/get_server_info").json()
        if info["num_used_tokens"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.2)


def test_plain_equals_chat_and_counts_equal_tokenize(oc, web) -> None:
    r = oc.responses.create(model="smol", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=24,
                            temperature=0)
    chat = oc.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smol"
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content and r.output_text.strip()
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    count = web.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens == count
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == count + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens <= count and r.usage.output_tokens_details.reasoning_tokens == 0
    # the same conversation as items with content parts: the same prompt, the same answer
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    again = oc.responses.create(model="smol", input=items, max_output_tokens=24, temperature=0)
    assert again.output_text == r.output_text and again.usage.input_tokens == count
    # max_output_tokens reached: incomplete, with OpenAI's reason
    short = oc.responses.create(model="smol", input=QUESTION, max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2


def test_streamed_events_come_in_the_documented_order(oc) -> None:
    kw = {"model": "smol", "instructions": INSTRUCTIONS, "input": QUESTION, "max_output_tokens": 24, "temperature": 0}
    whole = oc.responses.create(**kw)
    events = _events(oc.responses.create(stream=True, **kw))
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert text == done.text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id
    # the SDK's own accumulator rebuilds the same response from the events
    with oc.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


def test_function_call_round_trip_through_previous_response_id(oc) -> None:
    tools = [{"type": "web_search"}, *FLAT_TOOLS]  # a built-in tool: skipped (logged), not a 400
    first = oc.responses.create(model="smol", input="What is the weather in Paris?", tools=tools,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                temperature=0, parallel_tool_calls=False)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed", first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert [t.name for t in first.tools] == ["get_weather", "add"]
    result = json.dumps({"temperature_c": 21})
    second = oc.responses.create(model="smol", previous_response_id=first.id, tools=tools, max_output_tokens=16,
                                 temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                        "output": result}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the stored turn was prepended: the chat route given the whole conversation says the same
    chat = oc.chat.completions.create(model="smol", tools=CHAT_TOOLS, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    msg = chat.choices[0].message
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert [(o.name, o.arguments) for o in second.output if o.type == "function_call"] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    if not msg.tool_calls:
        assert second.output_text == (msg.content or "")
    # streamed, tool_choice required: the call's events
    events = _events(oc.responses.create(model="smol", input="Add 2 and 3.", tools=FLAT_TOOLS, tool_choice="required",
                                         max_output_tokens=80, temperature=0, parallel_tool_calls=False, stream=True))
    types = _collapse([e.type for e in events])
    assert types[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done = events[2].item, next(e for e in events if e.type == "response.output_item.done").item
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert added.type == "function_call" and added.status == "in_progress" and done.status == "completed"
    assert done.arguments == args and done.call_id == added.call_id
    jsonschema.validate(json.loads(args), {"add": ADD, "get_weather": WEATHER}[done.name])


def test_text_format_json_schema_holds(oc) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = oc.responses.create(model="smol", input="Name the capital of France as JSON.", text={"format": fmt},
                            max_output_tokens=40, temperature=0)
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    obj = oc.responses.create(model="smol", input="Give a JSON object with a key a.", max_output_tokens=8,
                              text={"format": {"type": "json_object"}}, temperature=0)
    assert obj.output_text.lstrip().startswith("{")  # the grammar holds from the first token


def test_stored_responses_are_got_deleted_and_continued(oc, web) -> None:
    r = oc.responses.create(model="smol", input="Say hi.", max_output_tokens=4, temperature=0,
                            metadata={"ticket": "42"})
    got = oc.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"ticket": "42"}
    assert oc.responses.delete(r.id) is None
    for call in (lambda: oc.responses.retrieve(r.id), lambda: oc.responses.delete(r.id),
                 lambda: oc.responses.create(model="smol", input="x", previous_response_id=r.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert r.id in err.value.message
    unstored = oc.responses.create(model="smol", input="Say hi.", max_output_tokens=2, store=False)
    assert web.get(f"/v1/responses/{unstored.id}").status_code == 404
    assert web.get(f"/v1/responses/{unstored.id}", params={"stream": "true"}).status_code == 400


def test_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(2)

    def entry(name: str, parent: StoredResponse | None = None) -> StoredResponse:
        return StoredResponse(body={"id": name, "output": [{"type": "message", "text": f"out-{name}"}]},
                              items=[{"type": "message", "text": f"in-{name}"}], parent=parent)

    a = entry("a")
    b = entry("b", a)
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # a is now the most recently used: b goes first
    store.put("c", entry("c", b))
    assert "b" not in store and "a" in store and len(store) == 2
    store.put("d", entry("d"))
    assert "a" not in store and store.get("b") is None
    # c continues b, which continues a: both evicted ids, the conversation is whole
    conv = store.get("c").conversation()
    assert [i["text"] for i in conv] == ["in-a", "out-a", "in-b", "out-b", "in-c", "out-c"]
    assert store.delete("c") and not store.delete("c")
    from radixserve.entrypoints.responses.routes import make_servings
    from radixserve.server_args import ServerArgs

    # --responses-store-size is the server's store's cap (the HTTP 404 of an evicted id: test_bad_input's first)
    serving = make_servings(None, ServerArgs(responses_store_size=3), None, {"chat": None})["responses"]
    assert serving.store.capacity == 3
    for bad in (0, -1, 100_001, True):
        with pytest.raises(ValueError, match="responses_store_size"):
            ServerArgs(responses_store_size=bad)


BAD = [
    ({"previous_response_id": "resp_from_nowhere"}, 404, "previous_response_id", "resp_from_nowhere"),
    ({"max_output_tokens": 10**12}, 400, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": "lots"}, 400, "max_output_tokens", "max_output_tokens"),
    ({"temperature": "hot"}, 400, "temperature", "temperature"),
    ({"input": 5}, 400, "input", "input"),
    ({"input": []}, 400, "input", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_unknown", "output": "1"}]}, 400, "input",
     "call_unknown"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "input", "takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, 400,
     "input", "file_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
    ({"tools": [{"type": "function", "parameters": {}}]}, 400, "tools", "tools.0.name"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {"type": "bogus"}}]}, 400,
     "tools", "tools.1.parameters"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice", "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", "text.format.schema"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning.effort", "reasoning.effort"),  # no reasoning parser here
    ({"background": True}, 400, "background", "background"),
    ({"conversation": "conv_1"}, 400, "conversation", "conversation"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include", "include"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "metadata"),
    ({"model": "no-such-model"}, 404, "model", "no-such-model"),
]


@pytest.mark.parametrize(("extra", "status", "param", "named"), BAD, ids=[b[2] + str(k) for k, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field_and_the_next_request_succeeds(web, extra, status, param, named) -> None:
    r = web.post("/v1/responses", json={"model": "smol", "input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"] and err["type"] == "invalid_request_error", err
    ok = web.post("/v1/responses", json={"model": "smol", "input": "Hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1, ok.text


def _open_stream(c: httpx.Client, body: dict):
    return c.stream("POST", "/v1/responses", json={**body, "stream": True})


def _sse(lines) -> dict | None:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    return None


def test_a_client_that_hangs_up_mid_stream_is_aborted_and_its_kv_freed(srv, web) -> None:
    def aborted() -> float:
        return sum(float(x.rsplit(" ", 1)[1]) for x in web.get("/metrics").text.splitlines()
                   if x.startswith("radixserve:num_requests_total{") and 'finish_reason="abort"' in x)

    before = aborted()
    body = {"model": "smol", "input": "Tell me a very long story about a dragon.", "max_output_tokens": 400}
    with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=120) as c, _open_stream(c, body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        deltas = 0
        while deltas < 3:  # hang up after three pieces of text
            event = _sse(lines)
            assert event is not None
            deltas += event["type"] == "response.output_text.delta"
    _wait_idle(web)
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)
    ok = web.post("/v1/responses", json={"model": "smol", "input": "Hi", "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_an_abort_mid_stream_is_an_error_event_and_response_failed(srv, web) -> None:
    body = {"model": "smol", "input": "Tell me a very long story about a knight.", "max_output_tokens": 400}
    with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=120) as c, _open_stream(c, body) as r:
        lines = r.iter_lines()
        created = _sse(lines)
        assert created["type"] == "response.created"
        rid = created["response"]["id"]
        while _sse(lines)["type"] != "response.output_text.delta":
            pass
        assert web.post("/abort_request", json={"rid": rid}).json()["success"]
        rest = []
        while (event := _sse(lines)) is not None:
            rest.append(event)
    kinds = [e["type"] for e in rest if e["type"] != "response.output_text.delta"]
    assert kinds == ["error", "response.failed"], kinds
    assert rest[-2]["code"] == "request_aborted" and rest[-1]["response"]["status"] == "failed"
    assert rest[-1]["response"]["error"]["code"] == "request_aborted"
    assert [e["sequence_number"] for e in rest] == list(range(rest[0]["sequence_number"],
                                                               rest[0]["sequence_number"] + len(rest)))
    _wait_idle(web)
    assert web.get(f"/v1/responses/{rid}").status_code == 404  # a failed response is not stored


# ---------------------------------------------------------------------------- reasoning
@pytest.fixture(scope="module")
def roc(reasoning_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_reasoning_items_and_the_effort_budget(roc, tokenizer) -> None:
    end_len = len(tokenizer.encode(THINK_END, add_special_tokens=False))
    room = 32  # SmolLM2 may end (EOS) inside its thinking after ~14 tokens: budgets below that are observable
    kw = {"model": "smol", "input": "Name a colour of the sky.", "max_output_tokens": room, "temperature": 0}
    low = roc.responses.create(reasoning={"effort": "low"}, **kw)
    assert low.output[0].type == "reasoning" and low.output[0].id.startswith("rs_")
    thought = low.output[0].content[0].text
    assert thought.strip() and THINK_END not in thought and low.output[0].summary == []
    assert low.usage.output_tokens_details.reasoning_tokens == room // 4 + end_len  # low = a quarter of the room
    minimal = roc.responses.create(reasoning={"effort": "minimal"}, **kw)
    assert minimal.usage.output_tokens_details.reasoning_tokens == room // 8 + end_len  # minimal = an eighth
    # the same as the chat route with that budget
    chat = roc.chat.completions.create(model="smol", messages=[{"role": "user", "content": kw["input"]}],
                                       max_tokens=room, temperature=0, extra_body={"thinking_budget": room // 4})
    assert (chat.choices[0].message.model_extra or {})["reasoning_content"] == thought
    assert low.output_text == (chat.choices[0].message.content or "")
    # streamed: the reasoning item's events first, then the message's
    events = _events(roc.responses.create(reasoning={"effort": "low"}, stream=True, **kw))
    types = _collapse([e.type for e in events])
    assert types[2:8] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.content_part.done", "response.output_item.done"]
    assert events[2].item.type == "reasoning"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    final = events[-1].response
    assert final.output_text == low.output_text and final.usage.output_tokens_details.reasoning_tokens == \
        low.usage.output_tokens_details.reasoning_tokens
