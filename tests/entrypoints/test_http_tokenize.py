"""POST /tokenize and /detokenize on the shared generation server, and /v1/embeddings refused there: the
tokens are the ones the generation routes use (count == their prompt_tokens), detokenize inverts tokenize,
and every bad input is a 400 naming the field, followed by a request that succeeds."""

from __future__ import annotations

import pytest

from tests.entrypoints.conftest import CONTEXT_LEN

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def _ok(http) -> None:
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text


def test_tokenize_a_prompt_as_the_generation_routes_do(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT_LEN
    assert "".join(body["token_strs"]) == "The quick brown fox"
    gen = http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 1}).json()
    assert gen["usage"]["prompt_tokens"] == body["count"]
    batch = http.post("/tokenize", json={"prompt": ["a b", "The quick brown fox"]}).json()
    assert batch["tokens"][1] == body["tokens"] and batch["count"] == [len(batch["tokens"][0]), body["count"]]
    assert batch["token_strs"] is None


def test_tokenize_messages_counts_what_chat_completions_sends(http):
    tok = http.post("/tokenize", json={"messages": CHAT}).json()
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"] == len(tok["tokens"])
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "Name a colour." in text["text"] and text["prompt"] == text["text"]


def test_detokenize_inverts_tokenize(http):
    prompts = ["Hello, world!", "  spaces  and\nnewlines", "ünïcödé ✓"]
    tokens = http.post("/tokenize", json={"prompt": prompts}).json()["tokens"]
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == prompts
    assert http.post("/detokenize", json={"tokens": tokens[0]}).json()["text"] == prompts[0]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": ["x"] * 10_000}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [[1], [-1]]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [[0]] * 10_000}, "tokens"),
])
def test_bad_input_then_a_normal_request(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    _ok(http)


def test_embeddings_on_a_generation_server_say_which_server_this_is(http):
    r = http.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400, r.text
    assert "text-generation server" in r.json()["error"]["message"]
    assert "--is-embedding" in r.json()["error"]["message"]
    _ok(http)
