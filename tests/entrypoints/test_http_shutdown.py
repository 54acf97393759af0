"""SIGTERM stops the whole server tree within 10 s, mid-stream, and leaves nothing behind.

This module runs last (file order): it stops the shared server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import httpx
import psutil


def test_sigterm_stops_the_process_tree(server) -> None:
    parent = psutil.Process(server.proc.pid)
    tree = [parent, *parent.children(recursive=True)]
    assert len(tree) >= 2, "the scheduler runs in a child process"
    assert any(n.startswith("radixserve-") for n in os.listdir(server.tmpdir)), (
        "IPC dir in the server's TMPDIR"
    )
    # A stream is running when the signal arrives.
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120
    ) as http:
        body = {"prompt": "Count to one hundred:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(httpx.HTTPError):  # the server ends the stream as it drains
                tail = [line for line in lines if line]
                assert tail[-1] == "data: [DONE]" and "shutting down" in "".join(tail)
        _, alive = psutil.wait_procs(tree, timeout=10)
        elapsed = time.monotonic() - start
    assert not alive, f"still running after {elapsed:.1f} s: {alive}"
    assert server.proc.wait(1) == 0, server.log()
    assert "radixserve: stopped" in server.log()
    assert not [n for n in os.listdir(server.tmpdir) if n.startswith("radixserve-")], "IPC files left behind"
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
