"""One real `radixserve serve` subprocess for the whole HTTP test session.

Loading a model costs tens of seconds on the shared CI box, so every HTTP test module shares
one server (`--context-length 256 --check-invariants --api-key ...`). The offline Engine that
the chat test compares against starts loading in a background thread as soon as the server
process is spawned, so the two loads overlap. test_http_shutdown.py runs last (file order) and
stops the server; the `server` fixture restarts it if a later test still needs one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
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

API_KEY = "test-key-123"
CONTEXT_LEN = 256
START_TIMEOUT_S = 900.0  # model load on a loaded 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `python -m radixserve serve` child; its TMPDIR is private so tests can see its IPC files."""

    extra_args: list[str]
    api_key: str = API_KEY
    context_len: int = CONTEXT_LEN
    port: int = field(default_factory=free_port)
    tmpdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rs-http-test-"))
    proc: subprocess.Popen | None = None
    log_path: str = ""
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path = os.path.join(self.tmpdir, "server.log")
        env = {**os.environ, "TMPDIR": self.tmpdir, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port), *self.extra_args]
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-6000:]
        except OSError:
            return ""

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SERVER_ARGS = [
    "--context-length",
    str(CONTEXT_LEN),
    "--check-invariants",
    "--api-key",
    API_KEY,
    "--max-total-tokens",
    "16384",
]


@dataclass
class _Pool:
    server: ServerProcess | None = None
    engine_future: concurrent.futures.Future | None = None
    tmpdirs: list[str] = field(default_factory=list)
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1)
    )


def _make_engine() -> Any:
    import radixserve

    # Same context length as the server; a smaller KV pool (the pool size never changes greedy output).
    return radixserve.Engine(
        model_path=None,
        check_invariants=True,
        context_length=CONTEXT_LEN,
        max_total_tokens=4096,
        show_progress=False,
    )


@pytest.fixture(scope="session")
def _pool(request: pytest.FixtureRequest) -> Iterator[_Pool]:
    pool = _Pool()
    yield pool
    if pool.server is not None:
        pool.server.stop()
    for tmpdir in pool.tmpdirs:  # each server's log and TMPDIR
        shutil.rmtree(tmpdir, ignore_errors=True)
    if pool.engine_future is not None:
        with contextlib.suppress(Exception):  # its load failed: that test already reported it
            pool.engine_future.result().shutdown()
    pool.executor.shutdown(wait=False)


def _session_wants_engine(session: pytest.Session) -> bool:
    return any("offline_engine" in getattr(item, "fixturenames", ()) for item in session.items)


def _ensure_server(pool: _Pool, session: pytest.Session) -> ServerProcess:
    """(Re)start the shared server if needed; the Engine's load overlaps its start-up."""
    if pool.server is None or not pool.server.alive():
        pool.server = ServerProcess(SERVER_ARGS)
        pool.tmpdirs.append(pool.server.tmpdir)
        pool.server.start()
        if pool.engine_future is None and _session_wants_engine(session):
            pool.engine_future = pool.executor.submit(_make_engine)
        pool.server.wait_ready()
    return pool.server


@pytest.fixture
def server(_pool: _Pool, request: pytest.FixtureRequest) -> ServerProcess:
    """The shared server (function-scoped so that a test after the shutdown test gets a new one)."""
    return _ensure_server(_pool, request.session)


@pytest.fixture(scope="module")
def offline_engine(_pool: _Pool, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The offline Engine (radixserve.Engine), shut down when the requesting module ends."""
    _ensure_server(_pool, request.session)
    if _pool.engine_future is None:
        _pool.engine_future = _pool.executor.submit(_make_engine)
    eng = _pool.engine_future.result()
    yield eng
    eng.shutdown()
    _pool.engine_future = None


@pytest.fixture
def client(server: ServerProcess) -> Any:
    """The official OpenAI client, pointed at the shared server."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300
    ) as c:
        yield c
