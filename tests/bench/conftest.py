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
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

API_KEY = "bench-key"
CONTEXT_LEN = 512
START_TIMEOUT_S = 900.0  # model load on a loaded 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BenchServer:
    port: int = field(default_factory=free_port)
    tmpdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rs-bench-"))
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.tmpdir, "server.log")

    def start(self) -> None:
        cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port), "--api-key", API_KEY,
               "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "8192", "--num-threads", "1"]
        env = {**os.environ, "TMPDIR": self.tmpdir, "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _make_engine() -> Any:
    import radixserve

    return radixserve.Engine(context_length=CONTEXT_LEN, max_total_tokens=4096, show_progress=False, num_threads=1)


@dataclass
class _Background:
    server: BenchServer | None = None
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
        bg.server = BenchServer()
        bg.server.start()
    if _wanted(request.session, "bench_engine"):
        bg.engine = bg.executor.submit(_make_engine)
    yield bg
    if bg.server is not None:
        bg.server.stop()
    if bg.engine is not None:
        with contextlib.suppress(Exception):  # its start failed: the test using it reported that
            bg.engine.result().shutdown()
    bg.executor.shutdown(wait=False)


@pytest.fixture(scope="session")
def bench_server(_bench_background: _Background) -> BenchServer:
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
