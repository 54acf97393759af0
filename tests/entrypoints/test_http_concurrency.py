"""Many streams at once, and streams whose clients go away, against a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Name a colour.",
    "Write one short sentence about the sea.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Give me a fruit that is yellow.",
    "What do bees make?",
    "Which planet is known as the red planet?",
]
COPIES = 8  # 8 prompts x 8 copies = 64 concurrent streams (the copies also share cached prefixes)
MAX_TOKENS = 16


def _chat_body(prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def _stream_text(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
    text, reason = "", None
    async with client.stream("POST", "/v1/chat/completions", json=_chat_body(prompt, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            reason = choice["finish_reason"] or reason
    return text, reason


def _wait_idle(http: httpx.Client, timeout_s: float = 120.0) -> dict:
    """Poll until no request runs or waits (aborts are reaped at the scheduler's next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get("/get_server_info").json()
        idle = (
            info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_used_tokens"] == 0
        )
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_64_concurrent_streams_equal_sequential(server, http) -> None:
    expected = {}
    for prompt in PROMPTS:  # one at a time
        r = http.post("/v1/chat/completions", json=_chat_body(prompt, False))
        assert r.status_code == 200, r.text
        expected[prompt] = r.json()["choices"][0]["message"]["content"]

    async def run_all() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(
            base_url=server.base_url,
            timeout=600,
            limits=limits,
            headers={"Authorization": f"Bearer {server.api_key}"},
        ) as client:
            return await asyncio.gather(*[_stream_text(client, p) for p in PROMPTS * COPIES])

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, (text, reason) in zip(PROMPTS * COPIES, results):
        assert reason in ("stop", "length")
        assert text == expected[prompt], prompt
    info = _wait_idle(http)
    assert info["num_used_tokens"] == 0


def test_disconnected_streams_free_their_kv(server, http) -> None:
    async def open_and_drop(client: httpx.AsyncClient, i: int) -> int:
        body = {**_chat_body(f"Tell me a long story about dragon number {i}.", True, 200), "ignore_eos": True}
        chunks = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:  # role chunk + two content chunks, then hang up
                    break
        return chunks

    async def give_up_waiting(client: httpx.AsyncClient, i: int) -> str:
        """A non-streaming request whose client times out: the server notices within a second."""
        body = {
            **_chat_body(f"Tell me a long story about knight number {i}.", False, 200),
            "ignore_eos": True,
        }
        try:
            await client.post("/v1/chat/completions", json=body, timeout=3)
        except httpx.TimeoutException:
            return "gave up"
        return "finished"

    async def run_all() -> list:
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=600, headers={"Authorization": f"Bearer {server.api_key}"}
        ) as client:
            return await asyncio.gather(
                *[open_and_drop(client, i) for i in range(10)],
                *[give_up_waiting(client, i) for i in range(2)],
            )

    assert asyncio.run(run_all()) == [3] * 10 + ["gave up"] * 2
    info = _wait_idle(http)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["num_used_tokens"] == 0  # nothing held beyond the radix cache
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200, flushed.text
    info = http.get("/get_server_info").json()
    assert info["num_cached_tokens"] == 0
    # the memory budget, part by part (model_executor/memory_budget.py): the KV pool is the one the server runs
    mem = info["memory_budget"]
    # the pool's first page is never handed out (padding writes land there)
    assert mem["kv_pool_tokens"] - info["max_total_num_tokens"] == info["page_size"] and mem["weights_bytes"] > 0
    assert mem["weights_bytes"] + mem["float_copy_bytes"] + mem["activations_bytes"] + mem["kv_pool_bytes"] \
        <= mem["budget_bytes"] <= mem["available_bytes"]
    # and the server still answers
    r = http.post("/v1/chat/completions", json=_chat_body("Hi", False, 2))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
