"""The HTTP process of a text model starts, and serves unconstrained requests, without loading torch: it
tokenises, routes and streams, and the scheduler process owns every tensor. torch's import is ~1.3 s of CPU and
~120 MiB at every server start, taken from the scheduler's load on a two-core machine (docs/architecture.md).

The first request with a grammar constraint loads it there after all (xgrammar, which checks the grammar's syntax
before anything is queued, imports torch), once. The suite's shared `server` has seen such requests, so this test
starts a server of its own.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server_process import ServerProcess


def _has_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    assert "python" in maps  # the check reads a Python process
    return "libtorch" in maps


@pytest.fixture(scope="module")
def fresh_server() -> Iterator[ServerProcess]:
    yield from ServerProcess(["--context-length", "256", "--max-total-tokens", "2048"]).running()


def test_the_http_process_serves_without_torch(fresh_server) -> None:
    assert fresh_server.proc is not None
    pid = fresh_server.proc.pid
    assert not _has_torch(pid), "the HTTP process loaded torch while starting"
    with httpx.Client(base_url=fresh_server.base_url, timeout=300) as http:
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
        assert chat.status_code == 200
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200 and any(line.startswith("data: ") for line in r.iter_lines())
        for path in ("/get_server_info", "/metrics", "/v1/models"):
            assert http.get(path).status_code == 200
        assert http.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        # refusals take the same roads: an embedding call to a generation server, an image to a text model
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 400
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        assert http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": [image]}]}).status_code == 400
        assert not _has_torch(pid), "the HTTP process loaded torch for an unconstrained request"
        # a grammar's syntax check (xgrammar) loads it, once, and the request is served as before
        regex = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3, "regex": "[ab]+"}})
        assert regex.status_code == 200
        assert _has_torch(pid)


def test_the_http_modules_import_without_torch() -> None:
    """The same rule at import time, in a fresh interpreter: every module the HTTP process imports, and the
    default model's config and tokenizer."""
    code = ("import sys\n"
            "import radixserve.entrypoints.launch_server, radixserve.entrypoints.http_server\n"
            "from radixserve.model_loader import default_model_path, get_model_config, get_tokenizer\n"
            "get_model_config(default_model_path()); get_tokenizer(default_model_path())\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
