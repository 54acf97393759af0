"""Faults and server-wide bounds, on a server of their own (small queue, small body limit, a fault
hook, CORS on, the API key from the environment):

- a generation that raises (RADIXSERVE_FAULT_INJECT) fails alone with a 500; concurrent requests
  answer exactly as they do alone;
- a full queue answers 429 with Retry-After; a too-large body 413;
- a control call to a stopped (SIGSTOP) scheduler times out with a 503 instead of hanging;
- killing the scheduler mid-load gives every client a 503 within 5 s and the server exits (status 1).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.server_process import ServerProcess

KEY = "env-key-456"
ORIGIN = "http://playground.test"
ARGS = ["--context-length", "256", "--max-total-tokens", "4096", "--check-invariants",
        "--max-running-requests", "4", "--max-queued-requests", "4", "--max-request-body-bytes", "65536",
        "--rpc-timeout", "2", "--allowed-origins", ORIGIN]


@pytest.fixture(scope="module")
def fault_server():
    srv = ServerProcess(ARGS, api_key=KEY, context_len=256,
                        env={"RADIXSERVE_FAULT_INJECT": "boom", "RADIXSERVE_API_KEY": KEY})
    yield from srv.running()


@pytest.fixture
def h(fault_server):
    with httpx.Client(base_url=fault_server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _scheduler(srv: ServerProcess) -> psutil.Process:
    return next(p for p in psutil.Process(srv.proc.pid).children() if "scheduler_process" in " ".join(p.cmdline()))


def _gen(h: httpx.Client, text: str, rid: str | None = None, n: int = 6) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    return h.post("/generate", json=body)


def test_api_key_from_the_environment(fault_server, h) -> None:
    cmdline = " ".join(psutil.Process(fault_server.proc.pid).cmdline())
    assert KEY not in cmdline  # the secret is not visible in `ps`
    assert httpx.get(fault_server.base_url + "/v1/models").status_code == 401
    assert h.get("/v1/models").status_code == 200


def test_cors_allows_only_the_configured_origin(fault_server) -> None:
    url = fault_server.base_url + "/v1/chat/completions"
    pre = httpx.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(url, headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.test"


def test_injected_fault_fails_alone(h) -> None:
    prompts = [f"Story number {i}:" for i in range(5)]
    alone = [_gen(h, p).json()["output_ids"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        bad = pool.submit(_gen, h, "Story number 9:", "boom-1")
        good = [pool.submit(_gen, h, p) for p in prompts]
        responses = [f.result() for f in good]
        failed = bad.result()
    assert failed.status_code == 500, failed.text
    err = failed.json()["error"]
    assert err["type"] == "server_error" and "injected fault" in err["message"]
    assert [r.status_code for r in responses] == [200] * 5
    assert [r.json()["output_ids"] for r in responses] == alone
    info = h.get("/get_server_info").json()
    assert info["num_failed_reqs"] >= 1 and info["num_used_tokens"] == 0
    assert h.get("/health_generate").status_code == 200


def test_health_degrades_after_a_streak_of_failures(fault_server, h) -> None:
    for k in range(8):
        assert _gen(h, "x", f"boom-streak-{k}", n=1).status_code == 500
    r = httpx.get(fault_server.base_url + "/health")
    assert r.status_code == 503 and "last 8 requests failed" in r.json()["error"]["message"], r.text
    assert _gen(h, "a good one", n=1).status_code == 200  # one success resets it
    assert httpx.get(fault_server.base_url + "/health").status_code == 200


def test_full_queue_is_429_with_retry_after(h) -> None:
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        statuses = [f.result() for f in [pool.submit(h.post, "/generate", json=body) for _ in range(12)]]
    codes = sorted(r.status_code for r in statuses)
    assert codes.count(200) >= 4 and 429 in codes and set(codes) <= {200, 429}, codes
    limited = next(r for r in statuses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"
    assert _gen(h, "after the burst").status_code == 200


def test_body_limit_from_the_flag(h) -> None:
    r = h.post("/v1/completions", content=b'{"prompt": "' + b"a" * 70_000 + b'"}',
               headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text


def test_control_call_times_out_on_a_stopped_scheduler(fault_server, h) -> None:
    sched = _scheduler(fault_server)
    sched.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = h.get("/get_server_info")
        assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10
    finally:
        sched.send_signal(signal.SIGCONT)
    assert h.get("/get_server_info").status_code == 200  # a late answer never confuses the next call


def test_scheduler_killed_mid_load(fault_server, h) -> None:
    """Runs last in this module: the server is gone afterwards."""
    sched = _scheduler(fault_server)
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(h.post, "/generate", json=body) for _ in range(4)]
        time.sleep(0.5)  # well inside the 200 tokens even on a fast CPU (a request that finished would not 503)
        t0 = time.monotonic()
        os.kill(sched.pid, signal.SIGKILL)
        results = [f.result() for f in futs]
        elapsed = time.monotonic() - t0
    assert all(r.status_code == 503 for r in results), [r.text for r in results]
    assert elapsed < 5, elapsed
    assert fault_server.proc.wait(30) == 1
    assert "scheduler process died" in fault_server.log()
