"""Every bad input gets its status and an OpenAI-shaped error body; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

CHAT = [{"role": "user", "content": "Hi"}]
GOOD_CHAT = {"messages": CHAT, "max_tokens": 1, "temperature": 0}

# (endpoint, body, status, param the error must name)
BAD_REQUESTS = [
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_k": 0}, 400, "top_k"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD_CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"max_tokens": 1}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400, "input_ids"),
    ("/v1/completions", {"max_tokens": 1}, 400, "prompt"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"bogus": 1}}, 400, None),
    ("/generate", {"text": "Hi", "sampling_params": {"spaces_between_special_tokens": False}}, 400,
     "spaces_between_special_tokens"),  # refused, not ignored (SamplingParams.verify says why)
    ("/abort_request", {}, 400, "rid"),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param, err
    if param:
        assert param.split(".")[0] in err["message"] or param == "model", err


def _still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=GOOD_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    BAD_REQUESTS,
    ids=[f"{p}-{s}-{param}" for p, _, s, param in BAD_REQUESTS],
)
def test_bad_request(http, path, body, status, param) -> None:
    _check_error(http.post(path, json=body), status, param)
    _still_serving(http)


def test_streaming_bad_request_is_not_a_stream(http) -> None:
    r = http.post("/v1/chat/completions", json={**GOOD_CHAT, "stream": True, "temperature": -1})
    _check_error(r, 400, "temperature")
    _still_serving(http)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json(http, raw) -> None:
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_api_key(server, http) -> None:
    url = server.base_url + "/v1/models"
    missing = httpx.get(url)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.post(server.base_url + "/v1/chat/completions", json=GOOD_CHAT).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # the liveness probe stays open
    for path in ("/health_generate", "/metrics", "/get_server_info", "/get_model_info"):
        assert httpx.get(server.base_url + path).status_code == 401, path  # everything else is behind it
    assert http.get("/v1/models").status_code == 200


def test_openai_client_errors(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_context_length_boundary(server, http) -> None:
    limit = server.context_len
    # max_tokens absent: OpenAI's default (16) is clamped to the one token the context leaves
    fits = http.post("/v1/completions", json={"prompt": [42] * (limit - 1), "temperature": 0})
    assert fits.status_code == 200, fits.text
    body = fits.json()
    assert body["usage"]["prompt_tokens"] == limit - 1 and body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"
    # an explicit max_tokens the context cannot hold is a 400 naming it (OpenAI's behaviour)
    _check_error(http.post("/v1/completions", json={"prompt": [42] * (limit - 1), "max_tokens": 4}),
                 400, "max_tokens")
    over = http.post("/v1/completions", json={"prompt": [42] * limit, "max_tokens": 1})
    _check_error(over, 400, "prompt")
    long_text = " hello" * (2 * limit)
    _check_error(
        http.post(
            "/v1/chat/completions", json={**GOOD_CHAT, "messages": [{"role": "user", "content": long_text}]}
        ),
        400,
        "prompt",
    )
    _still_serving(http)
