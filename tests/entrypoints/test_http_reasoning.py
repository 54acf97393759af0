"""Reasoning end to end: one real server on the default model with `--reasoning-parser auto` and a
chat template that opens `<think>` itself (and honours `enable_thinking`), driven by the official
openai client. SmolLM2 never closes a thinking by itself, so the thinking budget puts `</think>` at a
known place (after exactly N tokens), and a few-shot history makes it think a tool call before it
closes. Checked: the split, non-streamed and streamed alike (reasoning deltas first);
`enable_thinking: false` reaches the template; the budget; json_schema on the answer only; a call after
the thinking is returned and the one inside it is not; reasoning_tokens; separate_reasoning false.
Bad input: an unknown parser stops the start-up listing the known ones; budgets <= 0, over the
context, or given twice are 400s naming the field, each followed by a request that succeeds."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from radixserve.parser.reasoning_parser import REASONING_PARSER_NAMES, THINK_END
from tests.entrypoints.conftest import API_KEY, REASONING_CONTEXT
from tests.entrypoints.test_http_structured import ADD, TOOLS

CONTEXT = REASONING_CONTEXT
ASK = [{"role": "user", "content": "Name a colour of the sky."}]
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}}, "required": ["colour"]}
N = 8  # the thinking budget


@pytest.fixture(scope="module")
def srv(reasoning_server):
    return reasoning_server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def end_len(tokenizer) -> int:
    return len(tokenizer.encode(THINK_END, add_special_tokens=False))


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def _both(client, **kw):
    """(the non-streamed response, the streamed one folded: reasoning, content, tool calls, usage, order)."""
    kw = {"model": "smol", "messages": ASK, "temperature": 0.0, **kw}
    whole = client.chat.completions.create(**kw)
    reasoning, content, calls, usage, order, reason = "", "", {}, None, [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if r := _extra(d, "reasoning_content"):
            assert _extra(d, "reasoning") == r  # vLLM's newer name carries the same text
            reasoning += r
            order.append("r")
        if d.content:
            content += d.content
            order.append("c")
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": None, "args": ""})
            c["name"] = tc.function.name or c["name"]
            c["args"] += tc.function.arguments or ""
            order.append("t")
        reason = chunk.choices[0].finish_reason or reason
    assert order == sorted(order, key=lambda x: x != "r"), order  # every reasoning delta comes first
    return whole, {"reasoning": reasoning or None, "content": content, "calls": calls, "usage": usage,
                   "reason": reason}


def _same_split(whole, streamed) -> None:
    msg = whole.choices[0].message
    assert _extra(msg, "reasoning_content") == _extra(msg, "reasoning") == streamed["reasoning"]
    assert (msg.content or "") == streamed["content"]
    assert whole.choices[0].finish_reason == streamed["reason"]
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == \
        whole.usage.completion_tokens_details.reasoning_tokens


def test_the_budget_closes_the_thinking_at_n_tokens_and_the_answer_follows(client, end_len) -> None:
    # min_tokens: SmolLM2 would often end right after the forced marker; the answer must have tokens to show
    whole, streamed = _both(client, max_tokens=N + end_len + 24, logprobs=True,
                            extra_body={"thinking_budget": N, "min_tokens": N + end_len + 4})
    _same_split(whole, streamed)
    msg, usage = whole.choices[0].message, whole.usage
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    assert "".join(tokens[N:N + end_len]) == THINK_END and THINK_END not in "".join(tokens[:N])
    assert usage.completion_tokens_details.reasoning_tokens == N + end_len
    assert _extra(msg, "reasoning_content").strip() and msg.content.strip()  # the answer follows
    assert _extra(msg, "reasoning_content") == "".join(tokens[:N]).strip()
    # without a budget the model never closes it: the whole output is reasoning
    free = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=N + end_len + 4,
                                          extra_body={"min_tokens": N + end_len + 4})
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    assert free.usage.completion_tokens_details.reasoning_tokens == free.usage.completion_tokens == N + end_len + 4
    # the alias, as the max_thinking_tokens spelling
    alias = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=N + end_len + 24,
                                           extra_body={"max_thinking_tokens": N, "min_tokens": N + end_len + 4})
    assert alias.choices[0].message.content == msg.content


def test_json_schema_holds_on_the_answer_while_the_thinking_is_free(client, end_len) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    whole, streamed = _both(client, max_tokens=80, response_format=fmt, extra_body={"thinking_budget": N})
    _same_split(whole, streamed)
    msg = whole.choices[0].message
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    thought = _extra(msg, "reasoning_content")
    assert thought and not thought.lstrip().startswith("{")  # free text, not the grammar's
    assert whole.usage.completion_tokens_details.reasoning_tokens == N + end_len


FEW_SHOT = ASK + [
    {"role": "assistant", "content": '<think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                     '</tool_call>\n</think>\n\nBlue.'},
    {"role": "user", "content": "Name a colour of the sky."},
    {"role": "assistant", "content": '<think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                     '</tool_call>\n</think>\n\nBlue.'},
    {"role": "user", "content": "Name a colour of the sky."},
]


def test_a_call_inside_the_thinking_is_not_returned_one_after_it_is(client) -> None:
    whole, streamed = _both(client, messages=FEW_SHOT, tools=TOOLS, max_tokens=80, logprobs=True)
    _same_split(whole, streamed)
    msg = whole.choices[0].message
    thought = _extra(msg, "reasoning_content")
    assert '<tool_call>' in thought and '"add"' in thought, thought  # the model thought a call ...
    assert msg.tool_calls is None and streamed["calls"] == {}  # ... which is not returned
    assert whole.choices[0].finish_reason == "stop"
    # it closed the thinking itself: reasoning_tokens counts up to the token that completed </think>
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    closed = next(k for k in range(1, len(tokens) + 1) if THINK_END in "".join(tokens[:k]))
    assert whole.usage.completion_tokens_details.reasoning_tokens == closed < len(tokens)
    # tool_choice required: the structural tag starts after the thinking and the call there is returned
    whole, streamed = _both(client, messages=FEW_SHOT, tools=TOOLS, tool_choice="required", max_tokens=120,
                            parallel_tool_calls=False)
    _same_split(whole, streamed)
    msg = whole.choices[0].message
    assert '<tool_call>' in _extra(msg, "reasoning_content")
    assert whole.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name in ("add", "get_weather") and list(streamed["calls"]) == [0]
    assert streamed["calls"][0]["name"] == call.function.name and json.loads(streamed["calls"][0]["args"]) == args
    if call.function.name == "add":
        jsonschema.validate(args, ADD)


def test_enable_thinking_false_reaches_the_template(client, tokenizer) -> None:
    on = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=12)
    off = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=12,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                     "thinking_budget": 2})
    grown = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)) - len(
        tokenizer.encode("<think>\n", add_special_tokens=False))
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + grown  # the template closed the thinking
    msg = off.choices[0].message
    assert _extra(msg, "reasoning_content") is None and msg.content  # so all of the output is the answer
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert THINK_END not in msg.content  # and no budget forced a marker into it


def test_separate_reasoning_false_keeps_the_thinking_in_the_content(client, end_len) -> None:
    kw = {"max_tokens": N + end_len + 12}
    split = client.chat.completions.create(model="smol", messages=ASK, temperature=0, **kw,
                                           extra_body={"thinking_budget": N})
    whole, streamed = _both(client, **kw, extra_body={"thinking_budget": N, "separate_reasoning": False})
    _same_split(whole, streamed)
    msg = whole.choices[0].message
    assert _extra(msg, "reasoning_content") is None
    thought, answer = msg.content.split(THINK_END)
    assert thought.strip() == _extra(split.choices[0].message, "reasoning_content")
    assert answer.strip() == split.choices[0].message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == N + end_len


@pytest.mark.parametrize("body, field", [
    ({"thinking_budget": 0}, "thinking_budget"),
    ({"thinking_budget": -5}, "thinking_budget"),
    ({"thinking_budget": CONTEXT + 1}, "thinking_budget"),
    ({"max_thinking_tokens": 10**12}, "max_thinking_tokens"),
    ({"thinking_budget": 4, "max_thinking_tokens": 4}, "max_thinking_tokens"),
    ({"thinking_budget": "lots"}, "thinking_budget"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(100)}}, "chat_template_kwargs"),
])
def test_bad_budgets_are_400s_naming_the_field_and_the_server_goes_on(srv, body, field) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "smol", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    ok = httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, timeout=120,
                    json={"model": "smol", "messages": ASK, "max_tokens": 6, "thinking_budget": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 2


def test_unknown_parser_name_stops_the_start_listing_the_known_ones() -> None:
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--reasoning-parser", "deepthink"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ServerArgs.reasoning_parser" in proc.stderr and "deepthink" in proc.stderr
    assert all(name in proc.stderr for name in REASONING_PARSER_NAMES)
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="thinking_budget: needs --reasoning-parser"):
        ServerArgs(thinking_budget=100)
    with pytest.raises(ValueError, match=r"thinking_budget: must be an int in \[1, 64\]"):
        ServerArgs(reasoning_parser="qwen3", thinking_budget=65, context_length=64)
