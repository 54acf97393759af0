"""Fixtures of the benchmark tests: one real `radixserve serve` subprocess and one offline Engine,
both started (in the background) by the first benchmark test so that their model loads overlap
with the in-process ones (`model_runner`, `hf_oracle` from tests/conftest.py).

Every benchmark runs at a tiny size: the tests check the output's schema and its arithmetic
(throughput == tokens / duration, p99 >= median, ...), never how fast anything is. The server and
the Engine get one torch thread each: three processes share the machine during these tests, and
oversubscribed OpenMP GEMMs slow down many times over.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.server_process import ServerProcess

API_KEY = "bench-key"
CONTEXT_LEN = 512


def make_bench_server() -> ServerProcess:
    args = ["--api-key", API_KEY, "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "8192", "--num-threads", "1"]
    return ServerProcess(args, api_key=API_KEY, context_len=CONTEXT_LEN)


def _make_engine() -> Any:
    import radixserve

    return radixserve.Engine(context_length=CONTEXT_LEN, max_total_tokens=4096, show_progress=False, num_threads=1)


@dataclass
class _Background:
    server: ServerProcess | None = None
    engine: concurrent.futures.Future | None = None
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1))


def _wanted(session: pytest.Session, name: str) -> bool:
    return any(name in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def _bench_background(request: pytest.FixtureRequest) -> Iterator[_Background]:
    """At the first benchmark test, start the server process and the Engine that later tests of
    this session will use, so their model loads run while other tests work."""
    bg = _Background()
    if _wanted(request.session, "bench_server"):
        bg.server = make_bench_server()
        bg.server.start()
    if _wanted(request.session, "bench_engine"):
        bg.engine = bg.executor.submit(_make_engine)
    yield bg
    if bg.server is not None:
        bg.server.stop()
        shutil.rmtree(bg.server.tmpdir, ignore_errors=True)
    if bg.engine is not None:
        with contextlib.suppress(Exception):  # its start failed: the test using it reported that
            bg.engine.result().shutdown()
    bg.executor.shutdown(wait=False)


@pytest.fixture(scope="session")
def bench_server(_bench_background: _Background) -> ServerProcess:
    assert _bench_background.server is not None
    _bench_background.server.wait_ready()
    return _bench_background.server


@pytest.fixture(scope="session")
def bench_engine(_bench_background: _Background) -> Any:
    assert _bench_background.engine is not None
    return _bench_background.engine.result()



@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """In-process benchmarks of a module run on one torch thread (restored afterwards): results are
    only checked for consistency, and one thread does not fall off the oversubscription cliff."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
