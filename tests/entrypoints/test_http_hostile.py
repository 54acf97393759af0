"""Hostile input against the shared server: every bound answers its documented 4xx with an
OpenAI-shaped body, and afterwards a normal request is answered and the KV pool is empty again.
The first two cases are the issue's reproductions (they used to kill the scheduler / stall the queue)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.entrypoints.test_http_errors import _check_error

CHAT = [{"role": "user", "content": "Hi"}]
GOOD = {"messages": CHAT, "max_tokens": 2, "temperature": 0}
# JSON text, not dicts: json.dumps itself would recurse too deep to write these
DEEP = "[" * 100_000 + "]" * 100_000  # the reproduction: a RecursionError (500) in json.loads
OBJ70 = '{"a": ' * 70 + "1" + "}" * 70  # past the 64-level bound, well inside the recursion limit
CHAT_JSON = '"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2'
LONG_INT = "1" + "0" * 1000  # 1001 digits: past the decoder's bound on a number

HOSTILE = [
    # the two reproductions
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000000,
                   "sampling_params": {"max_new_tokens": 2}}, 400, "top_logprobs_num"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    # what a code read found
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**300}}, 400, "max_new_tokens"),
    ("/v1/chat/completions", {**GOOD, "max_tokens": 10**300}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD, "n": 129}, 400, "n"),
    ("/v1/chat/completions", {**GOOD, "n": 10**300}, 400, "n"),
    ("/v1/chat/completions", {**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {**GOOD, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/chat/completions", {**GOOD, "stop": ["x" * 257]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(17))}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ["hi"] * 257, "max_tokens": 1}, 400, "prompt"),
    ("/generate", {"input_ids": [[1]] * 257}, 400, "prompt"),
    ("/generate", {"input_ids": [-5, 3]}, 400, "input_ids"),
    ("/generate", {"text": "hi", "timeout": -1}, 400, "timeout"),
    ("/generate", {"text": "hi", "rid": "x" * 300}, 400, "rid"),
    # raw JSON that Python reads as inf / NaN
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e400}', 400,
     "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', 400, "max_tokens"),
    ("/generate", b'{"text": "hi", "sampling_params": {"top_p": NaN}}', 400, "top_p"),
    # hostile shapes, bounded before the recursive decoder (json_bounds.py): one per body route ...
    ("/v1/completions", f'{{"prompt": {DEEP}, "max_tokens": 1}}'.encode(), 400, "prompt"),
    ("/generate", f'{{"input_ids": {DEEP}}}'.encode(), 400, "input_ids"),
    ("/v1/chat/completions", f'{{"messages": {DEEP}}}'.encode(), 400, "messages"),
    ("/abort_request", f'{{"rid": {DEEP}}}'.encode(), 400, "rid"),
    # ... deep objects where the API takes free-form objects ...
    ("/v1/chat/completions", f'{{{CHAT_JSON}, "logit_bias": {{"1": {OBJ70}}}}}'.encode(), 400, "logit_bias"),
    ("/v1/chat/completions", f'{{{CHAT_JSON}, "tools": [{{"type": "function", "function": {{"name": "f", '
                             f'"parameters": {OBJ70}}}}}]}}'.encode(), 400, "tools"),
    ("/v1/chat/completions", f'{{{CHAT_JSON}, "response_format": {{"type": "json_schema", "json_schema": '
                             f'{{"name": "x", "schema": {OBJ70}}}}}}}'.encode(), 400, "response_format"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{OBJ70}]}}]}}'.encode(), 400,
     "messages"),
    ("/generate", f'{{"text": "hi", "sampling_params": {{"json_schema": {OBJ70}}}}}'.encode(), 400,
     "sampling_params"),
    # ... and huge numbers: past the decoder's bound, and past float's range where a float is wanted
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 1, "seed": {LONG_INT}}}'.encode(), 400, "seed"),
    ("/generate", f'{{"input_ids": [1, {LONG_INT}]}}'.encode(), 400, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 10**400}}, 400,
     "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"1": 10**400}}}, 400,
     "logit_bias"),
]


def _kv_returns_to_zero(http: httpx.Client, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get("/get_server_info").json()
        if info["num_used_tokens"] == 0 and info["num_running_reqs"] == 0 and info["num_in_flight_reqs"] == 0:
            return
        assert time.monotonic() < deadline, {k: info[k] for k in ("num_used_tokens", "num_running_reqs")}
        time.sleep(0.2)


def _still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    _kv_returns_to_zero(http)


@pytest.mark.parametrize(("path", "body", "status", "param"), HOSTILE,
                         ids=[f"{i}-{p}-{param}" for i, (p, _, _, param) in enumerate(HOSTILE)])
def test_hostile_input(http, path, body, status, param) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    _check_error(r, status, param)
    _still_serving(http)


def test_every_body_route_bounds_nesting(http) -> None:
    """Every route /openapi.json lists with a JSON body (the ones added later too) answers the deep body 400."""
    spec = http.get("/openapi.json").json()
    routes = [path for path, ops in spec["paths"].items() for op in ops.values()
              if isinstance(op, dict) and "requestBody" in op]
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"} <= set(routes)
    for path in routes:
        r = http.post(path, content=f'{{"x": {DEEP}}}'.encode(), headers={"Content-Type": "application/json"})
        body = r.json()
        if path.startswith("/v1/messages"):  # Anthropic's error shape (entrypoints/anthropic/)
            assert r.status_code == 400 and body["type"] == "error", r.text
            assert body["error"]["type"] == "invalid_request_error" and "x" in body["error"]["message"]
        elif path.startswith("/api/"):  # Ollama's (entrypoints/ollama/)
            assert r.status_code == 400 and isinstance(body["error"], str) and "x" in body["error"], r.text
        else:
            _check_error(r, 400, "x")
            assert body["error"]["code"] == "invalid_json"
    _still_serving(http)


def test_long_chat_without_max_tokens_is_admitted(http) -> None:
    """A chat request without max_tokens asks for 'the rest of the context': it must run, not wait."""
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 0, "stop": ["."]})
    assert r.status_code == 200, r.text
    _still_serving(http)


@pytest.mark.parametrize(("ctype", "status"), [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                               ("multipart/form-data; boundary=x", 415), (None, 415)])
def test_post_bodies_must_be_json(server, ctype, status) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    if ctype:
        headers["Content-Type"] = ctype
    r = httpx.post(server.base_url + "/v1/chat/completions", content=b'{"messages": []}', headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_body_over_the_limit_is_413(server, http) -> None:
    big = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'  # over the default 8 MiB
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(10):
            yield b"a" * (1024 * 1024)

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    _still_serving(http)


def test_no_cors_unless_allowed(server) -> None:
    r = httpx.get(server.base_url + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    pre = httpx.options(server.base_url + "/v1/chat/completions",
                        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_models_expose_no_paths(http) -> None:
    for card in http.get("/v1/models").json()["data"]:
        assert "/" not in (card.get("root") or "") and "/" not in card["id"]


def _stream_first_event(server, body: dict) -> None:
    """Open a stream, read its first event, then hang up (a disconnect mid-generation)."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))


def test_duplicate_live_rid_is_400_and_reuse_after_disconnect_is_clean(server, http) -> None:
    long_body = {"text": "Count slowly:", "rid": "dup-1", "stream": True,
                 "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
    done = threading.Event()
    t = threading.Thread(target=lambda: (_stream_first_event_and_wait(server, long_body, done)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while http.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = http.post("/generate", json={"text": "hi", "rid": "dup-1", "sampling_params": {"max_new_tokens": 1}})
        _check_error(r, 400, "rid")
    finally:
        done.set()
        t.join()
    # right after a disconnect: the old request's tokens never reach the new one
    _stream_first_event(server, {**long_body, "rid": "reuse-1"})
    fresh = {"text": "The capital of France is", "rid": "reuse-1",
             "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    for _ in range(100):
        r = http.post("/generate", json=fresh)
        if r.status_code == 200:
            break
        _check_error(r, 400, "rid")  # still retiring the old one: refused, never mixed up
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    lone = http.post("/generate", json={**fresh, "rid": "reuse-ref"}).json()
    assert r.json()["output_ids"] == lone["output_ids"] and r.json()["meta_info"]["completion_tokens"] == 3
    _kv_returns_to_zero(http)


def _stream_first_event_and_wait(server, body: dict, done: threading.Event) -> None:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        done.wait(60)


def test_abort_matches_exact_rids_only(server, http) -> None:
    body = {"text": "Count slowly:", "rid": "chatcmpl-victim", "stream": True,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}}
    events: list[str] = []

    def consume() -> None:
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                          timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=consume)
    t.start()
    while not events and t.is_alive():
        time.sleep(0.05)
    prefix = http.post("/abort_request", json={"rid": "chatcmpl"}).json()
    assert prefix == {"success": False, "aborted": []}
    t.join()
    assert '"completion_tokens": 24' in events[-2] or '"completion_tokens":24' in events[-2], events[-2]
    _kv_returns_to_zero(http)


def test_n_children_abort_with_their_parent(server, http) -> None:
    body = {"text": "Count slowly:", "rid": "fam", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "n": 2, "temperature": 0.7}}
    seen = threading.Event()

    def consume() -> None:
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                          timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.set()

    t = threading.Thread(target=consume)
    t.start()
    assert seen.wait(60)
    res = http.post("/abort_request", json={"rid": "fam"}).json()
    assert res["success"] and sorted(res["aborted"]) == ["fam-0", "fam-1"]
    t.join(60)
    _kv_returns_to_zero(http)


def test_request_timeout_is_408_and_frees_kv(http) -> None:
    body = {"text": "Count slowly:", "timeout": 0.3,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
    r = http.post("/generate", json=body)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    _still_serving(http)


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
])
def test_unimplemented_openai_fields_are_refused_by_name(http, field, value) -> None:
    r = http.post("/v1/chat/completions", json={**GOOD, field: value})
    _check_error(r, 400, field)
    assert r.json()["error"]["code"] == "unsupported_parameter"
    ok = http.post("/v1/chat/completions", json={**GOOD, "response_format": {"type": "text"}, "user": "u1"})
    assert ok.status_code == 200, ok.text  # plain text and unknown SDK extras are fine


def test_default_model_name_answers(http) -> None:
    r = http.post("/v1/chat/completions", json={**GOOD, "model": "default"})
    assert r.status_code == 200, r.text


def test_abort_on_an_openai_route_is_an_error_not_a_new_finish_reason(server, http) -> None:
    result: dict = {}

    def run() -> None:
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                          timeout=120) as c:
            result["r"] = c.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 200, "ignore_eos": True,
                                                          "rid": "oa-abort"})

    t = threading.Thread(target=run)
    t.start()
    for _ in range(200):
        if http.post("/abort_request", json={"rid": "oa-abort"}).json()["success"]:
            break
        t.join(0.1)
    t.join(120)
    r = result["r"]
    assert r.status_code == 409 and r.json()["error"]["code"] == "request_aborted", r.text
    _kv_returns_to_zero(http)
