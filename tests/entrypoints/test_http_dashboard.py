"""The web routes over HTTP (the browser tests are in tests/browser): the page is open and loads
nothing from elsewhere; the metric stream, the tree and the step log need the key; every parameter
has a bound (an absurd value is a 400 naming it); one poller serves every stream; a stream whose
client goes away is cleaned up."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from radixserve.entrypoints.web.metrics_feed import MAX_STREAMS
from radixserve.entrypoints.web.routes import STATIC_DIR, _index_page
from tests.entrypoints.test_http_errors import _check_error, _still_serving
from tests.server_process import ServerProcess

STREAM = "/v1/stream/metrics"


def _events(server, n: int, query: str = "interval_ms=250&steps=16", timeout: float = 60) -> list[dict]:
    """Open a metric stream, read n snapshots, close it."""
    out = []
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.stream("GET", f"{server.base_url}{STREAM}?{query}", headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == n:
                    break
    return out


def _num_streams(server) -> int:
    # the 2nd snapshot was polled after this stream opened (the 1st may be the cached one from before)
    return _events(server, 2)[1]["num_streams"] - 1  # minus the stream that asked


def test_the_page_is_open_and_self_contained(server) -> None:
    r = httpx.get(server.base_url + "/")  # no key: the page holds no data
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    config = json.loads(re.search(r'id="rs-config">(.*?)</script>', r.text).group(1))
    assert config["api_key_required"] is True
    files = sorted(p.name for p in Path(STATIC_DIR).iterdir())
    assert {"index.html", "app.js", "api.js", "chat.js", "dashboard.js", "tree.js", "trace.js", "style.css"} <= set(files)
    for name in files:
        text = (Path(STATIC_DIR) / name).read_text()
        # no CDN, no font or script from another origin: every reference is the page's own
        assert not re.search(r"""(src|href|from|import|url)\s*[=(]?\s*["']?(https?:)?//""", text), name
        if name != "index.html":
            got = httpx.get(f"{server.base_url}/web/{name}")
            assert got.status_code == 200 and got.text == text, name
    _check_error(httpx.get(server.base_url + "/web/nope.js"), 404, None)


def test_without_a_key_the_page_asks_for_none() -> None:
    config = json.loads(re.search(r'id="rs-config">(.*?)</script>', _index_page(False)).group(1))
    assert config == {"api_key_required": False, "version": config["version"], "dp_size": 1}


def test_the_open_prefix_does_not_open_other_routes(server) -> None:
    # a raw path (clients normalise "..") must not reach /metrics without the key
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /web/../metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert not reply.startswith(b"HTTP/1.1 200") and b"radixserve:" not in reply


@pytest.mark.parametrize("path", [STREAM, "/debug/radix_tree", "/debug/steps"])
def test_the_endpoints_need_the_key(server, path: str) -> None:
    _check_error(httpx.get(server.base_url + path), 401, None)
    _check_error(httpx.get(server.base_url + path, headers={"Authorization": "Bearer wrong"}), 401, None)


ABSURD = [
    (STREAM, "interval_ms", "0"), (STREAM, "interval_ms", "249"), (STREAM, "interval_ms", "60001"),
    (STREAM, "interval_ms", "9" * 40), (STREAM, "interval_ms", "abc"), (STREAM, "interval_ms", "1e3"),
    (STREAM, "steps", "-1"), (STREAM, "steps", "65"), (STREAM, "steps", "10000000000"),
    ("/debug/radix_tree", "max_nodes", "0"), ("/debug/radix_tree", "max_nodes", "2001"),
    ("/debug/radix_tree", "max_nodes", str(10**12)), ("/debug/radix_tree", "max_depth", "0"),
    ("/debug/radix_tree", "max_depth", "257"), ("/debug/radix_tree", "max_depth", "-5"),
    ("/debug/steps", "limit", "0"), ("/debug/steps", "limit", "513"), ("/debug/steps", "rid", "x" * 257),
]


@pytest.mark.parametrize(("path", "param", "value"), ABSURD, ids=[f"{p}-{q}-{v[:12]}" for p, q, v in ABSURD])
def test_absurd_parameters_are_400s(http, path: str, param: str, value: str) -> None:
    r = http.get(path, params={param: value})
    _check_error(r, 400, param)
    assert r.json()["error"]["code"] == "invalid_value"


def test_a_parameter_given_twice_is_a_400(http) -> None:
    _check_error(http.get(STREAM + "?steps=1&steps=2"), 400, "steps")
    _still_serving(http)


def test_a_snapshot_is_the_server_info_and_the_step_records(server, http) -> None:
    rid = f"dash-{uuid.uuid4().hex[:8]}"
    r = http.post("/generate", json={"text": "The lighthouse", "rid": rid,
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    info = http.get("/get_server_info").json()
    snap = _events(server, 1, "interval_ms=250&steps=64")[0]
    assert snap["error"] is None
    kv = snap["kv"]
    assert kv["free"] + kv["running"] + kv["cached"] == kv["total"] == info["max_total_num_tokens"]
    assert kv["cached_locked"] + kv["cached_evictable"] == kv["cached"]
    for key in ("max_total_num_tokens", "num_cached_tokens", "generation_tokens", "prompt_tokens",
                "num_retractions"):
        assert snap["server_info"][key] == info[key], key  # idle server: the same counters
    assert kv["running"] == 0 and snap["server_info"]["num_running_reqs"] == 0
    mine = [s for s in snap["steps"] if rid in s["schedule"]["rids"]]
    assert [s["schedule"]["mode"] for s in mine][-3:] == ["DECODE"] * 3
    for step in snap["steps"]:
        assert set(step) >= {"step", "time", "schedule", "forward", "timing"}
        assert set(step["forward"]) >= {"forward_mode", "batch_size", "num_tokens", "positions_range"}
        assert set(step["timing"]) == {"schedule_ms", "build_ms", "forward_ms", "sample_ms"}


def test_one_request_trace(http) -> None:
    rid = f"trace-{uuid.uuid4().hex[:8]}"
    r = http.post("/generate", json={"text": "Once upon a time in a lighthouse", "rid": rid,
                                     "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    meta = r.json()["meta_info"]
    steps = http.get("/debug/steps", params={"rid": rid}).json()["steps"]
    assert len(steps) == 5  # one prefill, then one decode per further token
    first = steps[0]["schedule"]
    i = first["rids"].index(rid)
    assert first["mode"] in ("PREFILL", "EXTEND")
    assert first["prefix_lens"][i] == meta["cached_tokens"]
    assert first["prefix_lens"][i] + first["extend_lens"][i] == meta["prompt_tokens"]
    assert [s["schedule"]["mode"] for s in steps[1:]] == ["DECODE"] * 4
    latest = http.get("/debug/steps", params={"limit": 3}).json()
    assert len(latest["steps"]) == 3 and latest["steps"][-1]["step"] == latest["last_step"]
    assert http.get("/debug/steps", params={"rid": "no-such-request"}).json()["steps"] == []


def test_the_tree_shows_a_shared_prefix(http) -> None:
    system = f"You keep the lighthouse on rock {uuid.uuid4().hex[:6]}. Answer like a sailor."
    for question in ("What do you see at night?", "Who brings the supplies?"):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 3, "temperature": 0}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    tree = http.get("/debug/radix_tree", params={"max_nodes": 2000, "max_depth": 256}).json()
    assert tree["enabled"] and tree["nodes"]
    shared = [n for n in tree["nodes"] if "lighthouse on rock" in n["text"]]
    assert len(shared) == 1 and shared[0]["num_children"] == 2, shared
    kids = [n["text"] for n in tree["nodes"] if n["parent"] == shared[0]["id"]]
    assert any("What do you see" in t for t in kids) and any("Who brings" in t for t in kids)
    one = http.get("/debug/radix_tree", params={"max_nodes": 1}).json()
    assert len(one["nodes"]) == 1 and one["truncated"]


def test_one_poller_serves_every_stream(server) -> None:
    """5 streams at the fastest interval for ~3 s: they all see the same snapshots, and the scheduler is
    asked at most ~4 times a second in all (snapshot numbers count the polls)."""
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        runs = list(pool.map(lambda _: _events(server, 12, "interval_ms=250&steps=0"), range(5)))
    seqs = sorted({e["seq"] for run in runs for e in run})
    started = min(run[0]["time"] for run in runs)
    ended = max(run[-1]["time"] for run in runs)
    polls_per_s = (seqs[-1] - seqs[0]) / max(1e-6, ended - started)
    assert polls_per_s <= 4.5, (polls_per_s, seqs)
    assert all(e["steps"] == [] for run in runs for e in run)


def test_disconnected_streams_are_cleaned_up(server) -> None:
    before = _num_streams(server)
    for _ in range(100):  # connect, read one snapshot, hang up
        _events(server, 1)
    deadline = time.monotonic() + 10
    while (left := _num_streams(server)) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == before == 0


def test_too_many_streams_is_a_429(server, http) -> None:
    opened: list[httpx.Response] = []
    client = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60,
                          limits=httpx.Limits(max_connections=MAX_STREAMS + 4))
    try:
        for _ in range(MAX_STREAMS):
            resp = client.send(client.build_request("GET", STREAM + "?interval_ms=1000"), stream=True)
            assert resp.status_code == 200
            opened.append(resp)
        _check_error(client.get(STREAM), 429, None)
        _still_serving(http)
    finally:
        for resp in opened:
            resp.close()
        client.close()
    deadline = time.monotonic() + 10
    while _num_streams(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _num_streams(server) == 0


def test_open_dashboards_do_not_hold_up_a_shutdown() -> None:
    """SIGTERM with dashboards connected: their streams end at once (not after the 30 s graceful
    timeout) and the server exits cleanly. A server of its own: this one is stopped."""
    srv = ServerProcess(["--api-key", "stop-key", "--context-length", "128", "--max-total-tokens", "2048",
                         "--graceful-shutdown-timeout", "30"], api_key="stop-key", context_len=128)
    srv.start()
    try:
        srv.wait_ready()
        ended: list[str] = []

        def watch() -> None:
            try:
                _events(srv, 10_000)  # until the server ends the stream
                ended.append("ended")
            except httpx.HTTPError as e:
                ended.append(f"{type(e).__name__}: {e}")

        watchers = [threading.Thread(target=watch) for _ in range(3)]
        for t in watchers:
            t.start()
        deadline = time.monotonic() + 60
        while _num_streams(srv) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(25) == 0, srv.log()
        elapsed = time.monotonic() - start
        for t in watchers:
            t.join(10)
        assert elapsed < 15, f"exit took {elapsed:.1f} s"
        assert ended == ["ended"] * 3, ended
        assert "radixserve: stopped" in srv.log()
    finally:
        srv.stop()
