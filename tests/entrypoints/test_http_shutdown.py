"""SIGTERM drains: a running stream finishes, new requests are refused (503 or no listener), then
the whole server tree stops and leaves nothing behind.

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
        body = {"prompt": "Count to one hundred:", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # a new request is not taken: the listener is closed (or, on a live connection, 503)
            with contextlib.suppress(httpx.TransportError):
                late = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert late.status_code == 503, late.text
            tail = [line for line in lines if line]  # the running stream drains to its end
            assert tail[-1] == "data: [DONE]", tail[-3:]
            assert '"finish_reason":"length"' in "".join(tail), tail[-3:]
        _, alive = psutil.wait_procs(tree, timeout=20)
        elapsed = time.monotonic() - start
    assert not alive, f"still running after {elapsed:.1f} s: {alive}"
    assert server.proc.wait(1) == 0, server.log()
    assert "radixserve: stopped" in server.log()
    assert not [n for n in os.listdir(server.tmpdir) if n.startswith("radixserve-")], "IPC files left behind"
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
