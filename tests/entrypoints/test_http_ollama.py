"""Ollama's API (/api/*) on the real servers, driven by the official `ollama` client and LangChain's ChatOllama:
chat (streamed as NDJSON and not), generate (templated and raw), list / show / ps / version, embed on the
embedding server, tools on the structured server, think on the reasoning server, format as a JSON schema.
Equality: each greedy answer equals /v1/chat/completions' (or /v1/completions' for a raw prompt) for the same
messages and settings, and the counts equal /tokenize's. Bad input (unknown model, absurd num_predict, wrong
types, unknown options, a 5 MB prompt) is a 4xx in Ollama's {"error": "..."} shape, each followed by a request
that succeeds; an NDJSON client that hangs up mid-stream has its request aborted and its KV freed."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from radixserve.function_call.tool_prompt import template_supports_tools
from tests.entrypoints.conftest import API_KEY, CONTEXT_LEN, EMBED_KEY
from tests.entrypoints.test_http_structured import TOOLS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "What is a radix tree?"}]
GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"]}


def _client(srv, key: str = API_KEY) -> ollama.Client:
    return ollama.Client(host=srv.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def _openai_chat(http: httpx.Client, messages, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _durations_ok(final) -> None:
    for name in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(final, name), int) and getattr(final, name) > 0, name
    assert final.load_duration == 0 and final.total_duration >= final.eval_duration


def _wait_idle(http: httpx.Client, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get("/get_server_info").json()
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_used_tokens"] == 0) \
                or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def _ok(c: ollama.Client) -> None:
    """The request that follows every bad one."""
    r = c.generate(model="default", prompt="Hi", options={"num_predict": 1, **GREEDY})
    assert r.done and r.eval_count == 1


def test_chat_streamed_and_not_equals_openai_and_tokenize(server, http) -> None:
    c = _client(server)
    ref = _openai_chat(http, MSGS, max_tokens=12)
    tokens = http.post("/tokenize", json={"messages": MSGS}).json()["count"]
    whole = c.chat(model="default", messages=MSGS, options={"num_predict": 12, **GREEDY}, stream=False)
    assert whole.message.content == ref["choices"][0]["message"]["content"] and whole.message.role == "assistant"
    assert whole.done and whole.done_reason == "length" == ref["choices"][0]["finish_reason"]
    assert whole.prompt_eval_count == tokens == ref["usage"]["prompt_tokens"] and whole.eval_count == 12
    _durations_ok(whole)
    parts = list(c.chat(model="default:latest", messages=MSGS, options={"num_predict": 12, **GREEDY}, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    final = parts[-1]
    assert final.model == "default:latest" and final.done_reason == "length"
    assert (final.prompt_eval_count, final.eval_count) == (tokens, 12)
    _durations_ok(final)
    # the wire: NDJSON by default (no `stream` field), one object per line, nothing else
    with httpx.stream("POST", server.base_url + "/api/chat", headers=AUTH, timeout=300,
                      json={"model": "default", "messages": MSGS, "options": {"num_predict": 3, **GREEDY}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert {"done_reason", "prompt_eval_count", "eval_count", "total_duration", "load_duration",
            "prompt_eval_duration", "eval_duration"} <= set(lines[-1])


def test_generate_templated_raw_and_empty(server, http) -> None:
    c = _client(server)
    ref = _openai_chat(http, [{"role": "system", "content": "Be brief."}, *MSGS], max_tokens=8)
    r = c.generate(model="default", prompt=MSGS[0]["content"], system="Be brief.", options={"num_predict": 8, **GREEDY})
    assert r.response == ref["choices"][0]["message"]["content"] and r.prompt_eval_count == ref["usage"]["prompt_tokens"]
    streamed = list(c.generate(model="default", prompt=MSGS[0]["content"], system="Be brief.", stream=True,
                               options={"num_predict": 8, **GREEDY}))
    assert "".join(p.response for p in streamed) == r.response and streamed[-1].eval_count == 8
    # raw: the prompt as it is, as /v1/completions reads it; no num_predict runs to EOS or the context's end
    prompt = "The capital of France is"
    comp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, **GREEDY}).json()
    raw = c.generate(model="default", prompt=prompt, raw=True, options={"num_predict": 6, **GREEDY})
    assert raw.response == comp["choices"][0]["text"] and raw.prompt_eval_count == comp["usage"]["prompt_tokens"]
    # an empty prompt is Ollama's "load the model" call: done at once, nothing generated
    empty = c.generate(model="default", prompt="")
    assert empty.done and empty.done_reason == "load" and empty.response == "" and empty.eval_count is None
    loaded = c.chat(model="default", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_format_json_schema_and_logprobs(server, http) -> None:
    c = _client(server)
    ask = [{"role": "user", "content": "Name a colour of the sky."}]
    ref = _openai_chat(http, ask, max_tokens=30, logprobs=True, top_logprobs=2, response_format={
        "type": "json_schema", "json_schema": {"name": "format", "schema": SCHEMA}})
    r = c.chat(model="default", messages=ask, format=SCHEMA, options={"num_predict": 30, **GREEDY}, logprobs=True,
               top_logprobs=2)
    assert r.message.content == ref["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    want = [(t["token"], t["logprob"], [a["token"] for a in t["top_logprobs"]]) for t in ref["choices"][0]["logprobs"]["content"]]
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in r.logprobs] == want
    plain = c.generate(model="default", prompt="Name a colour.", format="json", options={"num_predict": 12, **GREEDY})
    assert plain.response.lstrip().startswith("{")


def test_list_show_ps_version_and_probes(server, http) -> None:
    c = _client(server)
    info = http.get("/get_model_info").json()
    names = [m.model for m in c.list().models]
    assert names == [f"{info['served_model_name']}:latest"]
    shown = c.show("default")
    tools = ["tools"] if shown.template and template_supports_tools(shown.template) else []
    assert shown.capabilities == ["completion", *tools]
    arch = shown.modelinfo["general.architecture"]
    assert arch == "llama" and shown.modelinfo[f"{arch}.context_length"] == CONTEXT_LEN == info["context_len"]
    assert shown.details.family == "llama" and shown.details.format
    running = c.ps().models
    assert [m.model for m in running] == names and running[0].context_length == CONTEXT_LEN
    version = httpx.get(server.base_url + "/api/version", headers=AUTH).json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # VS Code's Ollama provider needs at least this
    assert httpx.head(server.base_url + "/").status_code == 200  # Ollama's clients probe it, with no key
    # the gate and unknown routes answer in Ollama's shape too
    bad_key = httpx.get(server.base_url + "/api/tags", headers={"Authorization": "Bearer nope"})
    assert bad_key.status_code == 401 and list(bad_key.json()) == ["error"]
    missing = http.get("/api/nope")
    assert missing.status_code == 404 and list(missing.json()) == ["error"]


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "nope", "messages": MSGS}, 404, "model 'nope' not found"),
    ({"model": "nope:latest", "prompt": "hi"}, 404, "model 'nope:latest' not found"),
    ({"messages": MSGS}, 400, "model is required"),
    ({"model": "default", "messages": MSGS, "options": {"num_predict": 10**12}}, 400, "options.num_predict"),
    ({"model": "default", "messages": MSGS, "options": {"num_predict": -3}}, 400, "options.num_predict"),
    ({"model": "default", "messages": MSGS, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"model": "default", "messages": MSGS, "options": {"top_k": 1.5}}, 400, "options.top_k"),
    ({"model": "default", "messages": MSGS, "options": {"temperature": -1}}, 400, "options.temperature"),
    ({"model": "default", "messages": MSGS, "options": {"num_ctx": CONTEXT_LEN + 1}}, 400, "options.num_ctx"),
    ({"model": "default", "messages": MSGS, "options": {"num_gpu": 1}}, 400, "options.num_gpu"),
    ({"model": "default", "messages": MSGS, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ({"model": "default", "messages": MSGS, "options": {"flux": 1}}, 400, "options.flux: unknown option"),
    ({"model": "default", "messages": MSGS, "options": [1]}, 400, "options"),
    ({"model": "default", "messages": "hi"}, 400, "messages"),
    ({"model": "default", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "default", "messages": MSGS, "format": "yaml"}, 400, "format"),
    ({"model": "default", "messages": MSGS, "think": "high"}, 400, "think"),
    ({"model": "default", "messages": MSGS, "think": True}, 400, "think: this server splits no thinking"),
    ({"model": "default", "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ({"model": "default", "prompt": "hi", "context": [1, 2]}, 400, "context"),
    ({"model": "default", "prompt": "hi", "images": ["aGk="]}, 400, "takes no images"),
    ({"model": "default", "prompt": "hi", "images": ["aGk="], "raw": True}, 400, "images: a raw prompt"),
    ({"model": "default", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
     "takes no images"),
    ({"model": "default", "prompt": "hi", "raw": True, "system": "x"}, 400, "system"),
    ({"model": "default", "prompt": "a" * 5_000_000}, 400, "prompt"),
])
def test_bad_input_is_an_ollama_error_then_a_request_succeeds(server, http, body, status, needle) -> None:
    path = "/api/generate" if "prompt" in body else "/api/chat"
    r = http.post(path, json={"stream": False, **body})
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and needle in r.json()["error"], r.json()
    _ok(_client(server))


def test_the_official_client_raises_the_status_and_message(server) -> None:
    c = _client(server)
    with pytest.raises(ollama.ResponseError, match="model 'missing' not found") as e:
        c.chat(model="missing", messages=MSGS)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="options.num_predict") as e:
        c.chat(model="default", messages=MSGS, options={"num_predict": 10**9}, stream=True).__next__()
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="text-generation server") as e:
        c.embed(model="default", input="x")
    assert e.value.status_code == 400
    _ok(c)


def test_langchain_chat_ollama(server, http) -> None:
    from langchain_ollama import ChatOllama

    ref = _openai_chat(http, MSGS, max_tokens=10)
    llm = ChatOllama(model="default", base_url=server.base_url, client_kwargs={"headers": AUTH}, temperature=0,
                     num_predict=10)
    out = llm.invoke(MSGS[0]["content"])
    assert out.content == ref["choices"][0]["message"]["content"]
    assert out.usage_metadata["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert out.usage_metadata["output_tokens"] == 10


def test_a_client_that_hangs_up_mid_stream_frees_its_kv(server, http) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "options": {"num_predict": 200, **GREEDY}}
    for _ in range(2):
        with httpx.stream("POST", server.base_url + "/api/chat", json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert json.loads(next(lines))["done"] is False and json.loads(next(lines))["done"] is False
        # hung up after two objects, 198 tokens short of the end
    info = _wait_idle(http)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_used_tokens"] == 0
    _ok(_client(server))


# ---------------------------------------------------------------------------- tools (the structured server)
WEATHER_SHOTS = [  # two earlier calls, so that SmolLM2 answers the third question with a call too
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
    {"role": "user", "content": "What is the weather like in Rome today?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                      "arguments": {"city": "Rome"}}}]},
    {"role": "user", "content": "What is the weather like in London today?"},
]


def test_tool_calls_have_object_arguments_and_round_trip(structured_server) -> None:
    c = _client(structured_server)
    shown = c.show("smol")
    assert "completion" in shown.capabilities
    opts = {"num_predict": 30, **GREEDY}
    whole = c.chat(model="smol", messages=WEATHER_SHOTS, tools=TOOLS, options=opts)
    calls = whole.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.arguments, dict) and "city" in calls[0].function.arguments
    # the same call /v1/chat/completions makes for the same messages, its arguments as a JSON string there
    openai_msgs = [{**m, "tool_calls": [{"id": f"c{k}", "type": "function", "function": {
        "name": t["function"]["name"], "arguments": json.dumps(t["function"]["arguments"])}} for t in m["tool_calls"]]}
        if m.get("tool_calls") else m for k, m in enumerate(WEATHER_SHOTS)]
    with httpx.Client(base_url=structured_server.base_url, headers=AUTH, timeout=300) as http:
        ref = _openai_chat(http, openai_msgs, tools=TOOLS, max_tokens=30)
    ref_call = ref["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (calls[0].function.name, calls[0].function.arguments) == (ref_call["name"], json.loads(ref_call["arguments"]))
    parts = list(c.chat(model="smol", messages=WEATHER_SHOTS, tools=TOOLS, options=opts, stream=True))
    streamed = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [(t.function.name, t.function.arguments)
                                                                           for t in calls]
    assert parts[-1].done and parts[-1].done_reason == whole.done_reason
    # the result goes back named by tool_name, with no id: a reply comes
    history = [*WEATHER_SHOTS, {"role": "assistant", "content": "", "tool_calls": [calls[0].model_dump()]},
               {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature_c": 14})}]
    reply = c.chat(model="smol", messages=history, tools=TOOLS, options={"num_predict": 4, **GREEDY})
    assert reply.done and reply.eval_count == 4 and (reply.message.content or reply.message.tool_calls)


# ---------------------------------------------------------------------------- think (the reasoning server)
def test_think_true_and_false(reasoning_server) -> None:
    c = _client(reasoning_server)
    assert "thinking" in c.show("smol").capabilities
    ask = [{"role": "user", "content": "Name a colour of the sky."}]
    with httpx.Client(base_url=reasoning_server.base_url, headers=AUTH, timeout=300) as http:
        on = _openai_chat(http, ask, model="smol", max_tokens=6)
        off = _openai_chat(http, ask, model="smol", max_tokens=6, chat_template_kwargs={"enable_thinking": False})
    # SmolLM2 never closes a thinking by itself: all 6 tokens are the thinking
    r = c.chat(model="smol", messages=ask, think=True, options={"num_predict": 6, **GREEDY})
    assert r.message.thinking == on["choices"][0]["message"]["reasoning_content"] and r.message.thinking
    assert r.message.content == "" and r.done_reason == "length"
    parts = list(c.chat(model="smol", messages=ask, think=True, options={"num_predict": 6, **GREEDY}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts).strip() == r.message.thinking.strip()
    # think false reaches the template (enable_thinking): the whole output is the answer
    r = c.chat(model="smol", messages=ask, think=False, options={"num_predict": 6, **GREEDY})
    assert r.message.content == off["choices"][0]["message"]["content"] and r.message.thinking is None
    assert r.prompt_eval_count == off["usage"]["prompt_tokens"]
    g = c.generate(model="smol", prompt=ask[0]["content"], think=True, options={"num_predict": 6, **GREEDY})
    assert g.thinking == on["choices"][0]["message"]["reasoning_content"] and g.response == ""


# ---------------------------------------------------------------------------- embeddings (the embedding server)
def test_embed_equals_v1_embeddings_truncates_and_legacy(embed_server) -> None:
    c = _client(embed_server, EMBED_KEY)
    assert c.show("default").capabilities == ["embedding"]
    with httpx.Client(base_url=embed_server.base_url, headers={"Authorization": f"Bearer {EMBED_KEY}"},
                      timeout=300) as http:
        ref = http.post("/v1/embeddings", json={"input": ["hello world", "bonjour"]}).json()
        counts = http.post("/tokenize", json={"prompt": ["hello world", "bonjour"]}).json()["count"]
        long_text = " ".join(["river stone"] * 200)  # over the 256-token context
        ids = http.post("/tokenize", json={"prompt": long_text}).json()["tokens"]
        cut = http.post("/v1/embeddings", json={"input": ids[:CONTEXT_LEN - 1]}).json()["data"][0]["embedding"]
        refused = http.post("/api/embed", json={"model": "default", "input": long_text, "truncate": False})
        assert refused.status_code == 400 and "input" in refused.json()["error"], refused.text
        chat = http.post("/api/chat", json={"model": "default", "messages": MSGS, "stream": False})
        assert chat.status_code == 400 and "embedding server" in chat.json()["error"]
    r = c.embed(model="default:latest", input=["hello world", "bonjour"])
    assert r.prompt_eval_count == sum(counts) and len(r.embeddings) == 2
    for got, want in zip(r.embeddings, ref["data"]):
        assert np.abs(np.asarray(got) - np.asarray(want["embedding"])).max() < 1e-6
    assert len(c.embed(model="default", input="hello world", dimensions=32).embeddings[0]) == 32
    truncated = c.embed(model="default", input=long_text).embeddings[0]  # Ollama's default: truncate
    assert np.abs(np.asarray(truncated) - np.asarray(cut)).max() < 1e-6
    legacy = c.embeddings(model="default", prompt="hello world").embedding
    assert np.abs(np.asarray(legacy) - np.asarray(ref["data"][0]["embedding"])).max() < 1e-6
    with pytest.raises(ollama.ResponseError, match="options.temperature"):
        c.embed(model="default", input="x", options={"temperature": 0})
    with pytest.raises(ollama.ResponseError, match="model 'other' not found"):
        c.embed(model="other", input="x")
    assert len(c.embed(model="default", input="still fine").embeddings) == 1
