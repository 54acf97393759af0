"""The HTTP process of a text model never loads torch: it tokenises, routes and streams, and the scheduler
process owns every tensor. torch's import is ~1.3 s of CPU and ~180 MiB at every server start, taken from the
scheduler's load on a two-core machine (docs/architecture.md, "Processes").
"""

from __future__ import annotations

import subprocess
import sys


def _loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_http_process_serves_without_torch(server, http) -> None:
    assert server.proc is not None
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                   "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and any(line.startswith("data: ") for line in r.iter_lines())
    for path in ("/get_server_info", "/metrics", "/v1/models"):
        assert http.get(path).status_code == 200
    assert http.post("/tokenize", json={"prompt": "hello"}).status_code == 200
    # refusals take the same roads: an embedding call to a generation server, an image to a text model
    assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 400
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [image]}]}).status_code == 400
    maps = _loaded_libraries(server.proc.pid)
    assert "libtorch" not in maps, "the HTTP process loaded torch"
    assert "python" in maps  # the check reads the right process


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
