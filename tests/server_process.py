"""A real `python -m radixserve serve` child process for tests (HTTP tests and benchmark tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

START_TIMEOUT_S = 900.0  # model load on a loaded 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `python -m radixserve serve` child; its TMPDIR is private so tests can see its IPC files."""

    extra_args: list[str]
    api_key: str = ""  # what extra_args passed as --api-key (tests read it back)
    context_len: int = 0  # what extra_args passed as --context-length
    port: int = field(default_factory=free_port)
    tmpdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rs-test-server-"))
    proc: subprocess.Popen | None = None
    log_path: str = ""
    started_at: float = 0.0
    ready_after_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path = os.path.join(self.tmpdir, "server.log")
        env = {**os.environ, "TMPDIR": self.tmpdir, "TOKENIZERS_PARALLELISM": "false", **self.env}
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
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:  # /health needs no key
                    self.ready_after_s = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def running(self) -> Iterator[ServerProcess]:
        """Start, wait until ready, yield, stop: the body of every module-scoped server fixture."""
        self.start()
        try:
            self.wait_ready()
            yield self
        finally:
            self.stop()

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
