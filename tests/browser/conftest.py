"""Browser tests: Debian's chromium (/usr/bin/chromium, installed by `make setup` with apt-get) driven by
playwright through `executable_path` -- never `playwright install`, which downloads a browser.

One real `radixserve serve` (tests/server_process.py, like every server the suite starts) serves every
test of the module, with an API key so that the page's key field is exercised too. Each test gets a
fresh browser context that has typed the key; its teardown fails the test if the page logged a console
error or an uncaught exception, or tried to load anything from another origin (no CDN).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_process import ServerProcess

CHROMIUM = "/usr/bin/chromium"
API_KEY = "browser-key"
CONTEXT_LEN = 1024
# --check-invariants, as in the whole suite (it walks the pool after every step: a small pool keeps it cheap)
SERVER_ARGS = ["--api-key", API_KEY, "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "8192",
               "--check-invariants"]
TIMEOUT_MS = 120_000  # a loaded 2-core box can take a while for a prefill


@dataclass
class PageProblems:
    console_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def web_server() -> Iterator[ServerProcess]:
    srv = ServerProcess(SERVER_ARGS, api_key=API_KEY, context_len=CONTEXT_LEN)
    yield from srv.running()


@pytest.fixture(scope="module")
def api(web_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=web_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run `make setup` (it installs Debian's chromium with apt-get)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make setup` (it is in the test extra)")
    with sync_playwright() as p:
        # --no-sandbox: chromium's sandbox refuses to run as root (CI runs as root)
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, web_server: ServerProcess) -> Iterator[Any]:
    """The playground page, key entered and accepted."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    problems = PageProblems()
    base = web_server.base_url

    def only_this_server(route: Any) -> None:
        if route.request.url.startswith(base + "/"):
            route.continue_()
        else:
            problems.outside_requests.append(route.request.url)
            route.abort()

    context.route("**/*", only_this_server)
    pg = context.new_page()
    pg.on("console", lambda m: problems.console_errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.console_errors.append(f"uncaught: {e}"))
    pg.goto(base + "/")
    pg.fill("#api-key", API_KEY)
    pg.click("#key-save")
    pg.wait_for_selector("body[data-ready=true]")
    pg.problems = problems
    yield pg
    context.close()
    assert not problems.console_errors, problems.console_errors
    assert not problems.outside_requests, problems.outside_requests
