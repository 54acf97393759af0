"""OpenAI-compatible and native endpoints against a real server, with the official client."""

from __future__ import annotations

import json
import math

import httpx
import pytest

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_models_and_info(server, client, http, model_name) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].object == "model"
    info = http.get("/get_model_info").json()
    assert info["served_model_name"] == model_name
    assert info["context_len"] == server.context_len and info["vocab_size"] > 1000
    server_info = http.get("/get_server_info").json()
    for key in (
        "max_total_num_tokens",
        "num_used_tokens",
        "num_cached_tokens",
        "num_running_reqs",
        "num_waiting_reqs",
        "cache_hit_rate",
        "check_invariants",
        "port",
    ):
        assert key in server_info, key
    assert server_info["api_key"] != server.api_key  # the secret is never echoed
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


def test_completion_usage_matches_tokenizer(client, tokenizer, model_name) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == model_name
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_non_stream(client, model_name) -> None:
    kw = {
        "model": model_name,
        "prompt": ["Once upon a time", "The weather today"],
        "max_tokens": 5,
        "temperature": 0,
    }
    full = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    reasons, usage = {}, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens == full.usage.prompt_tokens


def test_n_with_seeds(client, tokenizer, model_name) -> None:
    kw = {"model": model_name, "prompt": "My favourite colour is", "max_tokens": 8, "temperature": 1.0}
    both = client.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage.completion_tokens <= 16  # the prompt counts once, the completions per choice
    assert both.usage.prompt_tokens == len(tokenizer.encode(kw["prompt"], add_special_tokens=False))
    # choice i runs with seed + i: it equals a single request with that seed (so it is reproducible)
    for i, choice in enumerate(both.choices):
        assert client.completions.create(n=1, seed=7 + i, **kw).choices[0].text == choice.text


def test_stop_sequence_trims_text(client, model_name) -> None:
    kw = {"model": model_name, "prompt": "1, 2, 3, 4,", "temperature": 0, "extra_body": {"ignore_eos": True}}
    free = client.completions.create(max_tokens=12, **kw).choices[0].text
    stop = free.strip()[:2].strip() or free[:1]
    assert stop, free
    out = client.completions.create(max_tokens=12, stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.startswith(out.text)


def test_completion_logprobs_and_echo(client, model_name) -> None:
    out = client.completions.create(
        model=model_name,
        prompt="Hello there",
        max_tokens=3,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("Hello there")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    generated = lp.token_logprobs[-3:]
    assert all(v is not None and v <= 0 for v in generated)
    for top, token, value in zip(lp.top_logprobs[-3:], lp.tokens[-3:], generated):
        assert token in top and 2 <= len(top) <= 3
        assert max(top.values()) >= value - 1e-4  # greedy: the sampled token is the best one
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_matches_offline_engine(client, tokenizer, offline_engine, model_name) -> None:
    out = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant"
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    offline = offline_engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    assert msg.content == offline["text"]
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens == offline["meta_info"]["completion_tokens"]
    assert (
        out.choices[0].finish_reason
        == {"stop": "stop", "length": "length"}[offline["meta_info"]["finish_reason"]["type"]]
    )


def test_chat_stream_logprobs_and_usage(client, model_name) -> None:
    kw = {
        "model": model_name,
        "messages": CHAT,
        "max_completion_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == full.choices[0].message.content
    assert bytes(content[0].bytes).decode() == content[0].token
    text, roles, reason, usage, streamed = "", [], None, None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
            reason = c.finish_reason or reason
    assert roles == ["assistant"] and text == full.choices[0].message.content
    assert reason == full.choices[0].finish_reason
    assert [t.token for t in streamed] == [t.token for t in content]
    assert usage.completion_tokens == full.usage.completion_tokens and usage.prompt_tokens_details is not None


def test_chat_n2_and_stop(client, model_name) -> None:
    out = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=4, temperature=0.9, n=2, seed=3
    )
    assert [c.index for c in out.choices] == [0, 1] and all(c.message.content for c in out.choices)
    assert 2 <= out.usage.completion_tokens <= 8
    assert (
        out.usage.prompt_tokens
        == client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1).usage.prompt_tokens
    )  # the prompt counts once
    greedy = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0)
    word = greedy.choices[0].message.content.split()[1]
    stopped = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=8, temperature=0, stop=word
    )
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].message.content
    assert greedy.choices[0].message.content.startswith(stopped.choices[0].message.content)


def test_native_generate(http) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 1,
    }
    out = http.post("/generate", json=body).json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["finish_reason"]["type"] in (
        "stop",
        "length",
    )
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
    assert all(math.isfinite(v) for v, _ in meta["output_token_logprobs"])
    events = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]


def test_abort_request_by_rid(server, http) -> None:
    import threading

    result: dict = {}

    def run() -> None:
        with httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=300
        ) as c:
            result["r"] = c.post(
                "/generate",
                json={
                    "text": "Tell me a long story",
                    "rid": "abort-me",
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                },
            )

    t = threading.Thread(target=run)
    t.start()
    for _ in range(100):  # wait until the scheduler has it
        if http.post("/abort_request", json={"rid": "abort-me"}).json()["success"]:
            break
        t.join(0.2)
    t.join(120)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 200
