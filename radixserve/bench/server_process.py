"""Servers a benchmark starts itself, on a free port, for the length of a `with` block: radixserve
(`python -m radixserve serve`) and its peer, llama.cpp's `llama-server` (a binary given by path, built
with shared/peers/build_llamacpp.sh; never a runtime dependency). Both are measured by the same client
in the same run, so a comparison is a ratio taken minutes apart on the same machine."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server_process(cmd: list[str], base: str, name: str, start_timeout_s: float = 900.0) -> Iterator[str]:
    """Run `cmd` until the block ends, once `base`/health answers 200; yields `base`."""
    log = tempfile.NamedTemporaryFile(prefix=f"rs-bench-{name}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} was not ready after {start_timeout_s:.0f} s; log: {log.name}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def local_radixserve(extra_args: list[str], api_key: str | None = None) -> Iterator[str]:
    """`radixserve serve` with `extra_args`; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    with server_process(cmd, f"http://127.0.0.1:{port}", "radixserve") as base:
        yield base


def check_binary(path: str, what: str) -> None:
    """Refuse a peer binary that cannot run, before anything is started or loaded."""
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise SystemExit(f"{what} {path}: not an executable file")


@contextlib.contextmanager
def local_llama_server(binary: str, gguf: str, threads: int, parallel: int = 1, ctx: int = 32768,
                       flash_attn: bool = True, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """llama.cpp's server on the same GGUF: `-np parallel` slots sharing a `-c ctx` context (`extra`: more flags,
    e.g. its KV types -ctk / -ctv)."""
    check_binary(binary, "llama-server")
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-np", str(parallel),
           "-c", str(ctx), *(["-fa"] if flash_attn else []), *extra]
    with server_process(cmd, f"http://127.0.0.1:{port}", "llama-server") as base:
        yield base
