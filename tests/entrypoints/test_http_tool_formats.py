"""The non-JSON tool formats end to end: a real server with `--tool-call-parser qwen3_coder` and with
`pythonic` on the default model (SmolLM2's template has no tool support, so the generic rendering
teaches the format), the official openai client, tool_choice required / named, streamed and not: the
structural tag forces the format, so the output always parses into calls whose arguments validate.
Bad input: an unknown parser name stops the start-up listing the known ones; absurd tool lists are
400s, each followed by a request that succeeds."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from radixserve.function_call.registry import TOOL_CALL_PARSERS
from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_http_structured import ASK, SCHEMA_OF, TOOLS
from tests.server_process import ServerProcess


@pytest.fixture(scope="module", params=["qwen3_coder", "pythonic"])
def fmt_server(request):
    srv = ServerProcess(["--tool-call-parser", request.param, "--context-length", "2048", "--max-total-tokens",
                         "16384", "--api-key", API_KEY, "--served-model-name", "smol"], api_key=API_KEY)
    for s in srv.running():
        yield request.param, s


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _stream_calls(client, **kw) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "args": "", "pieces": 0})
            if tc.id:
                c["id"], c["name"] = tc.id, tc.function.name
            c["args"] += tc.function.arguments or ""
            c["pieces"] += 1
        reason = chunk.choices[0].finish_reason or reason
    return calls, reason, content


def test_required_and_named_calls_parse_and_validate(fmt_server) -> None:
    _fmt, srv = fmt_server
    client = _client(srv)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kw = {"model": "smol", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0.0,
              "max_tokens": 200, "parallel_tool_calls": False}
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        call = ch.message.tool_calls[0]
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "add"
        calls, reason, content = _stream_calls(client, **kw)  # greedy: the stream gives the same call
        assert reason == "tool_calls" and list(calls) == [0] and not content.strip()
        c = calls[0]
        assert c["id"].startswith("call_") and c["name"] == call.function.name
        assert json.loads(c["args"]) == json.loads(call.function.arguments)
        assert c["pieces"] >= 3  # name, then the arguments one parameter at a time, then the close


def test_the_prompt_teaches_the_format_and_history_round_trips(fmt_server) -> None:
    _fmt, srv = fmt_server
    client = _client(srv)
    first = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    final = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, temperature=0,
                                           max_tokens=40)
    msg = final.choices[0].message
    assert msg.content or msg.tool_calls
    for c in msg.tool_calls or []:  # tool_choice auto: whatever is returned as a call validates
        assert c.function.name in SCHEMA_OF
        json.loads(c.function.arguments)


@pytest.mark.parametrize("body, needle", [
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x " * 300_000}}]}, "context"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
])
def test_absurd_tool_lists_are_400s_and_the_server_goes_on(fmt_server, body, needle) -> None:
    _, srv = fmt_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "smol", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert needle in err["message"] and err["type"], err
    ok = httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, timeout=120,
                    json={"model": "smol", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                          "max_tokens": 200})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"], ok.text


def test_unknown_parser_name_stops_the_start_listing_the_known_ones() -> None:
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--tool-call-parser", "qwen4_xml"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ServerArgs.tool_call_parser" in proc.stderr and "qwen4_xml" in proc.stderr
    assert all(name in proc.stderr for name in TOOL_CALL_PARSERS)
