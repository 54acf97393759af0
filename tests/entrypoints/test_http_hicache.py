"""The disk tier on a real server process: what a stopped (SIGTERM) or killed (kill -9) server cached is there
after a restart on the same directory; and a multi-turn chat keeps hitting its own previous turns.

The default mode (the GGUF's own low-bit blocks, the native decode stack) with a bfloat16 KV cache. The multi-turn
check runs on the restarted server (one server start less).
"""

from __future__ import annotations

import glob
import os
import random
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.server_process import ServerProcess

PROMPT_TOKENS = 2000


def hicache_server(storage: str) -> ServerProcess:
    return ServerProcess(["--enable-hierarchical-cache", "--hicache-storage-dir", storage, "--kv-cache-dtype",
                          "bfloat16", "--max-total-tokens", "12288", "--context-length", "4096"])


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hicache"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(300, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(3)]


def complete(base_url: str, prompt: list[int]) -> tuple[str, int]:
    r = httpx.post(base_url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def first_run(storage: str, prompts: list[list[int]]) -> Iterator[list[str]]:
    """A server computes the three prompts and is stopped with SIGTERM (it saves its cache on the way out)."""
    server = hicache_server(storage)
    server.start()
    try:
        server.wait_ready()
        texts = []
        for p in prompts:
            text, hit = complete(server.base_url, p)
            assert hit == 0
            texts.append(text)
    finally:
        server.stop()
    assert server.proc is not None and server.proc.returncode == 0, server.log()
    yield texts


def test_a_restarted_server_hits_what_the_stopped_one_cached(storage, prompts, first_run):
    server = hicache_server(storage)
    for s in server.running():
        for p, ref in zip(prompts, first_run):
            text, hit = complete(s.base_url, p)
            assert hit >= 0.9 * len(p), f"{hit} of {len(p)} cached after the restart"
            assert text == ref
        info = httpx.get(s.base_url + "/get_server_info", timeout=30).json()["hicache"]
        assert info["storage_hit_tokens"] >= 0.9 * 3 * PROMPT_TOKENS and info["storage_read_failures"] == 0
        metrics = httpx.get(s.base_url + "/metrics", timeout=30).text
        storage_hits = [line for line in metrics.splitlines()
                        if line.startswith("radixserve:hicache_hit_tokens{") and 'tier="storage"' in line]
        assert storage_hits and float(storage_hits[0].split()[-1]) == info["storage_hit_tokens"]
        assert 'radixserve:hicache_bytes{dp_rank="0",model_name=' in metrics or "hicache_bytes{" in metrics
        # the memory tier empties alone; ?storage=true is refused on no server but empties the disk too
        assert httpx.post(s.base_url + "/flush_cache", timeout=30).status_code == 200
        assert glob.glob(os.path.join(storage, "*", "*", "*.kv"))
        chat_six_turns(s.base_url)  # multi-turn: each turn hits the previous turn's prompt and answer


def test_kill_minus_9_mid_write_leaves_no_bad_entry(storage, prompts, first_run):
    """Reuse a new prompt until it is written through, kill -9 the server while the writes run, plant the debris
    a killed write leaves (and a truncated entry), restart: the server starts, and every answer is the same."""
    server = hicache_server(storage)
    fresh = [t + 1 for t in prompts[0][:1500]]
    server.start()
    server.wait_ready()
    ref_fresh, _ = complete(server.base_url, fresh)
    for _ in range(2):  # the second reuse triggers the write-through of its 23 blocks
        complete(server.base_url, fresh)
    server.proc.send_signal(signal.SIGKILL)  # its scheduler gets SIGKILL too (PR_SET_PDEATHSIG), mid-write or not
    server.proc.wait(30)
    entries = sorted(glob.glob(os.path.join(storage, "*", "*", "*.kv")))
    assert entries
    with open(entries[0] + ".12345.tmp", "wb") as f:
        f.write(b"\0" * 1000)  # what a write killed half-way leaves
    with open(entries[-1], "r+b") as f:
        f.truncate(os.path.getsize(entries[-1]) // 2)
    again = hicache_server(storage)
    for s in again.running():
        assert "removed" in s.log()  # the debris and the truncated entry: one log line
        for p, ref in zip(prompts, first_run):
            text, _ = complete(s.base_url, p)  # one block of one of them is gone: a shorter hit
            assert text == ref
        text, _ = complete(s.base_url, fresh)
        assert text == ref_fresh
        assert not glob.glob(os.path.join(storage, "*", "*", "*.tmp"))


def chat_six_turns(base_url: str) -> None:
    """Six turns through /v1/chat/completions: turn N+1's cached_tokens >= turn N's prompt + completion - 1
    (page_size 1; the token that ended turn N was sampled, never run, so it has no KV)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    questions = ["Name a colour.", "And a fruit of that colour?", "How does it taste?", "Where does it grow?",
                 "Name another one.", "Which do you prefer?"]
    previous = None
    for q in questions:
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)
        usage = r.usage
        if previous is not None:
            assert usage.prompt_tokens_details.cached_tokens >= previous - 1, (q, usage, previous)
        previous = usage.prompt_tokens + usage.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_flushing_storage_without_a_disk_tier_is_a_400(http):
    r = http.post("/flush_cache", params={"storage": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "storage"
    assert "no disk tier" in r.json()["error"]["message"]
    assert http.post("/flush_cache", params={"storage": "maybe"}).status_code in (400, 422)
