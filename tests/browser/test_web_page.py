"""The web page in a real headless chromium, as a person uses it: chat with streamed answers and usage,
stop and regenerate, the live dashboard under load, the radix tree after two requests that share a
prefix, a request's trace. The `page` fixture fails any test whose page logged a console error."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx

from tests.browser.conftest import TIMEOUT_MS


def _ask(page: Any, text: str) -> Any:
    page.fill("#chat-input", text)
    page.click("#send")
    return page.locator(".msg-assistant").last


def _settings(page: Any, **values: Any) -> None:
    for name, value in values.items():
        page.fill(f"#p-{name}", str(value))


def _abort_count(api: httpx.Client) -> float:
    text = api.get("/metrics").text
    m = re.search(r'^radixserve:num_requests_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _running(api: httpx.Client) -> int:
    return api.get("/get_server_info").json()["num_running_reqs"]


# Set before a request: a MutationObserver notes whether any DOM state of the page had an answer streaming with text
# in it. It sees every state the page passes through; polling for a selector can miss a 32-token answer that
# streams in ~0.2 s, between two looks.
WATCH_STREAMING_TEXT = """() => {
  window.sawStreamingText = false;
  new MutationObserver(() => {
    if (document.querySelector('.msg-assistant[data-state=streaming] .content:not(:empty)')) window.sawStreamingText = true;
  }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_chat_streams_an_answer_with_its_usage(page: Any) -> None:
    _settings(page, temperature=0, max_tokens=32)
    page.evaluate(WATCH_STREAMING_TEXT)
    answer = _ask(page, "What is a radix tree? Explain briefly.")
    page.wait_for_selector(".msg-assistant[data-state=done] .usage")
    # text appeared while the answer was still streaming ...
    assert page.evaluate("window.sawStreamingText")
    # ... in several pieces, and the usage line is filled in from the server's usage chunk
    assert int(answer.get_attribute("data-chunks")) >= 2
    assert answer.locator(".content").inner_text().strip()
    usage = answer.locator(".usage")
    prompt, completion = int(usage.get_attribute("data-prompt-tokens")), int(usage.get_attribute("data-completion-tokens"))
    assert prompt > 10 and 1 <= completion <= 32 and usage.get_attribute("data-cached-tokens") is not None
    text = usage.inner_text()
    assert "TTFT" in text and "ms" in text and ("tok/s" in text or completion == 1)
    assert page.is_enabled("#send") and not page.is_enabled("#stop") and page.is_enabled("#regenerate")

    # regenerate: the same conversation again, so its prompt now comes from the radix cache
    page.click("#regenerate")
    page.wait_for_selector(".msg-assistant[data-state=done] .usage")
    assert page.locator(".msg").count() == 2
    again = page.locator(".msg-assistant .usage")
    assert int(again.get_attribute("data-prompt-tokens")) == prompt
    assert int(again.get_attribute("data-cached-tokens")) >= prompt - 1


def test_stop_aborts_the_request(page: Any, api: httpx.Client) -> None:
    aborts = _abort_count(api)
    page.fill("#system-prompt", "You count. Write the numbers from 1 to 1000, one per line, and nothing else.")
    _settings(page, temperature=0, max_tokens=900)
    answer = _ask(page, "Start counting now.")
    page.wait_for_function(
        "() => (document.querySelector('.msg-assistant[data-state=streaming] .content')?.textContent || '').length > 20")
    assert _running(api) == 1  # it is decoding on the server now
    page.click("#stop")
    page.wait_for_selector(".msg-assistant[data-state=stopped]")
    assert answer.locator(".usage").inner_text().count("stopped") == 1
    deadline = time.monotonic() + 30
    while _running(api) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(api) == 0  # the server aborted it (the client went away)
    assert _abort_count(api) == aborts + 1
    assert api.get("/get_server_info").json()["num_used_tokens"] == 0
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def _load(api: httpx.Client, done: threading.Event, seen_enough: threading.Event, concurrency: int = 4,
          min_rounds: int = 2, max_rounds: int = 30) -> None:
    """Background chat load: waves of `concurrency` requests of 32 tokens, at least `min_rounds` and then
    until the watcher has seen what it looks for: on a fast CPU a wave lasts less than a few dashboard
    refreshes, so a fixed number of waves could come and go between two of them."""
    body = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}

    def one(i: int, r: int) -> None:
        msgs = [{"role": "user", "content": f"Tell me fact number {i + 10 * r} about lighthouses."}]
        assert api.post("/v1/chat/completions", json={**body, "messages": msgs}).status_code == 200

    try:
        for r in range(max_rounds):
            if r >= min_rounds and seen_enough.is_set():
                break
            threads = [threading.Thread(target=one, args=(i, r)) for i in range(concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        done.set()


def _dashboard_numbers(page: Any) -> dict[str, Any]:
    return page.evaluate("""() => {
        const n = (id) => parseFloat((document.getElementById(id).textContent || '').replace(/,/g, ''));
        const part = (p) => parseInt(document.querySelector(`#kv-bar [data-part=${p}]`).dataset.tokens || '-1');
        const first = document.querySelector('#pipeline tbody tr[data-step]');
        return {running: n('m-running'), output: n('m-output-tps'), input: n('m-input-tps'),
                kv_running: part('running'), kv_locked: part('cached_locked'), kv_cached: part('cached_evictable'),
                kv_free: part('free'), step: first ? parseInt(first.dataset.step) : -1,
                bs: Math.max(0, ...[...document.querySelectorAll('#pipeline tbody td:nth-child(3) .small')]
                        .map((e) => parseInt((e.textContent.match(/bs (\\d+)/) || [0, 0])[1])))};
    }""")


def test_dashboard_follows_a_background_load(page: Any, api: httpx.Client) -> None:
    page.click("a[data-view=dashboard]")
    page.wait_for_selector("#dash-status[data-kind=live]")
    total = api.get("/get_server_info").json()["max_total_num_tokens"]
    done, seen_enough = threading.Event(), threading.Event()
    load = threading.Thread(target=_load, args=(api, done, seen_enough))
    load.start()
    seen = []
    try:
        while not done.is_set():
            seen.append(_dashboard_numbers(page))
            if (max(x["running"] for x in seen) >= 2 and max(x["kv_running"] for x in seen) > 0
                    and max(x["bs"] for x in seen) >= 2 and len({x["step"] for x in seen}) >= 3):
                seen_enough.set()
            time.sleep(0.25)
    finally:
        load.join()
    # the numbers moved while the load ran: requests running, KV held by them, tokens/s, new steps
    assert max(s["running"] for s in seen) >= 2, seen[-5:]
    assert max(s["kv_running"] for s in seen) > 0
    assert max(s["output"] for s in seen) > 0 and max(s["input"] for s in seen) > 0
    assert len({s["step"] for s in seen}) >= 3
    assert max(s["bs"] for s in seen) >= 2  # a batched DECODE step in the pipeline
    # afterwards the KV bar is free + radix-cached only
    page.wait_for_function("""() => document.getElementById('m-running').textContent === '0'
        && document.querySelector('#kv-bar [data-part=running]').dataset.tokens === '0'
        && document.querySelector('#kv-bar [data-part=cached_locked]').dataset.tokens === '0'""", timeout=TIMEOUT_MS)
    end = _dashboard_numbers(page)
    assert end["kv_cached"] > 0 and end["kv_free"] + end["kv_cached"] == total
    # a request's row links to its trace
    link = page.locator("#pipeline a[href^='#trace/']").first
    rid = link.get_attribute("title")
    link.click()
    page.wait_for_selector("#trace-table tbody tr[data-step]")
    assert rid in page.inner_text("#trace-title")
    assert page.locator("#trace-table tbody tr[data-step]").count() >= 1
    assert "DECODE" in page.inner_text("#trace-table")


def test_tree_view_shows_a_shared_prefix(page: Any) -> None:
    page.fill("#system-prompt", "You are the keeper of the Skerryvore lighthouse. Answer like an old sailor.")
    _settings(page, temperature=0, max_tokens=8)
    for question in ("What do you see at night?", "Who brings your supplies?"):
        _ask(page, question)
        page.wait_for_selector(".msg-assistant[data-state=done] .usage")
        page.click("#new-chat")
    page.click("a[data-view=tree]")
    page.click("#tree-refresh")
    page.wait_for_selector("#tree-root[data-loaded]")
    shared = page.locator("details.tree-node:has(> summary .node-text:has-text('Skerryvore'))")
    assert shared.count() == 1
    assert int(shared.get_attribute("data-children")) == 2
    assert "shared by 2" in shared.locator(":scope > summary").inner_text()
    branches = shared.locator(":scope > .tree-children > .tree-node")
    texts = " ".join(branches.nth(i).inner_text() for i in range(branches.count()))
    assert "What do you see" in texts and "Who brings" in texts
    # collapsible: a click on the prefix folds its continuations away
    shared.locator(":scope > summary").click()
    assert not shared.locator(":scope > .tree-children").is_visible()
    assert "cached tokens" in page.inner_text("#tree-summary")
