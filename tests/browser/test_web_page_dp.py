"""The web page in front of a --dp-size 2 server (tiny random model): the dashboard lists both replicas
and tags each step with its replica; the radix-tree view shows the replica picked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import API_KEY, TIMEOUT_MS
from tests.distributed.conftest import make_tiny_model
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def web_server(tmp_path_factory, default_model_path: str) -> Iterator[ServerProcess]:
    """Replaces the conftest's server for this module: two replicas, round robin."""
    tiny = make_tiny_model(tmp_path_factory.mktemp("web-dp"), 4, 2)
    srv = ServerProcess(["--api-key", API_KEY, "--model-path", tiny, "--tokenizer-path", default_model_path,
                         "--dp-size", "2", "--load-balance-method", "round_robin", "--context-length", "256",
                         "--max-total-tokens", "1024", "--num-threads", "1"], api_key=API_KEY, context_len=256)
    yield from srv.running()


def test_dashboard_and_tree_show_each_replica(page: Any, api: httpx.Client) -> None:
    page.click("a[data-view=dashboard]")
    page.wait_for_selector("#dash-status[data-kind=live]")
    body = {"input_ids": [[5, 17, 99, 3, 42, 8], [7, 7, 7, 7, 7, 7]] * 2,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    assert api.post("/generate", json=body).status_code == 200
    page.wait_for_function("""() => {
        const rows = [...document.querySelectorAll('#replicas tbody tr[data-dp-rank]')];
        return !document.getElementById('replicas-panel').hidden && rows.length === 2
            && rows.every((r) => parseInt(r.children[4].textContent) >= 2);
    }""", timeout=TIMEOUT_MS)
    page.wait_for_function("""() => {
        const tags = [...document.querySelectorAll('#pipeline tbody tr[data-step] td:first-child .small')]
            .map((e) => e.textContent).filter((t) => t.startsWith('replica'));
        return tags.includes('replica 0') && tags.includes('replica 1');
    }""", timeout=TIMEOUT_MS)

    page.click("a[data-view=tree]")
    page.wait_for_selector("#tree-dp-rank", state="visible", timeout=TIMEOUT_MS)  # the view switch is async
    page.fill("#tree-dp-rank", "1")
    page.click("#tree-refresh")
    page.wait_for_function("() => document.getElementById('tree-summary').textContent.startsWith('replica 1:')",
                           timeout=TIMEOUT_MS)
    assert page.locator("#tree-root .tree-node").count() >= 1
