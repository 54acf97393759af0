"""The README's screenshots of the web page: docs/playground.png (a chat), docs/dashboard.png (the live
dashboard while a background load runs) and docs/radix_tree.png (the tree that load left), taken in
Debian's headless chromium through playwright, from a server this script starts (or --base-url).

    .venv/bin/python scripts/screenshots.py [--out docs] [--base-url URL --api-key KEY]

The server it starts runs --max-running-requests 4 (and a small KV pool, so the KV bar shows its
parts), so that the load of 6 clients also shows requests waiting, and why, in the pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from radixserve.bench.dashboard import local_server

CHROMIUM = "/usr/bin/chromium"
SYSTEM = "You are a helpful assistant who explains computer science to curious people."
QUESTIONS = ["What is a radix tree?", "Why do serving engines batch requests?", "What is a KV cache?",
             "Explain prefill and decode.", "What is continuous batching?", "Why share prompt prefixes?",
             "What limits decode speed?", "What is paged attention?"]


def background_load(base: str, key: str, stop: threading.Event, workers: int = 6) -> None:
    """`workers` clients, each sending chat requests one after the other (different lengths, so they
    drift apart: prefills land between decode steps), all with one system prompt (so the radix tree
    has something to share). More clients than --max-running-requests: some always wait."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def worker(w: int, client: httpx.Client) -> None:
        k = 0
        while not stop.is_set():
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": QUESTIONS[(w + k) % len(QUESTIONS)]}],
                    "max_tokens": 24 + 16 * ((w + k) % 5), "temperature": 0.7, "ignore_eos": True}
            with contextlib.suppress(httpx.HTTPError):
                client.post(base + "/v1/chat/completions", json=body)
            k += 1

    with httpx.Client(headers=headers, timeout=600, limits=httpx.Limits(max_connections=workers)) as client:
        threads = [threading.Thread(target=worker, args=(w, client)) for w in range(workers)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()


@contextlib.contextmanager
def page_of(base: str, key: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 860}, device_scale_factor=1)
        page.set_default_timeout(300_000)
        page.goto(base + "/")
        if key:
            page.fill("#api-key", key)
            page.click("#key-save")
        page.wait_for_selector("body[data-ready=true]")
        yield page
        browser.close()


def chat(page: Any, text: str) -> None:
    page.fill("#chat-input", text)
    page.click("#send")
    page.wait_for_selector(".msg-assistant[data-state=done] .usage >> nth=-1")
    page.wait_for_function("() => !document.querySelector('.msg-assistant[data-state=streaming]')")


def take(base: str, key: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with page_of(base, key) as page:
        page.fill("#system-prompt", SYSTEM)
        page.fill("#p-max_tokens", "96")
        chat(page, "What is a radix tree, in two or three sentences?")
        chat(page, "And why would an LLM serving engine keep one?")
        page.screenshot(path=os.path.join(out, "playground.png"))
        print("wrote", os.path.join(out, "playground.png"), flush=True)

        stop = threading.Event()
        load = threading.Thread(target=background_load, args=(base, key, stop), daemon=True)
        load.start()
        page.set_viewport_size({"width": 1360, "height": 1150})  # cards, KV bar, chart and ~8 pipeline rows
        page.click("a[data-view=dashboard]")
        page.select_option("#dash-interval", "250")
        page.wait_for_selector("#dash-status[data-kind=live]")
        time.sleep(15)  # let the chart fill and the pipeline show prefill, decode and a waiting queue
        page.wait_for_function("() => parseInt(document.getElementById('m-waiting').textContent) > 0"
                               " && document.querySelector('#pipeline .mode-EXTEND, #pipeline .mode-PREFILL')")
        page.screenshot(path=os.path.join(out, "dashboard.png"))
        print("wrote", os.path.join(out, "dashboard.png"), flush=True)
        stop.set()
        load.join()

        page.set_viewport_size({"width": 1360, "height": 860})
        page.click("a[data-view=tree]")
        page.fill("#tree-max-depth", "4")
        page.click("#tree-refresh")
        page.wait_for_selector("#tree-root[data-loaded]")
        page.screenshot(path=os.path.join(out, "radix_tree.png"))
        print("wrote", os.path.join(out, "radix_tree.png"), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs")
    p.add_argument("--base-url", default=None)
    p.add_argument("--api-key", default="screenshot-key")
    p.add_argument("--server-args", default="--max-running-requests 4 --max-total-tokens 4096")
    args = p.parse_args()
    if args.base_url:
        take(args.base_url.rstrip("/"), args.api_key, args.out)
        return
    with local_server(args.server_args.split(), args.api_key) as base:
        take(base, args.api_key, args.out)


if __name__ == "__main__":
    main()
