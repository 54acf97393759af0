"""Chat templates over HTTP: a base model's GGUF without one (Gemma 3 270M) serves completions and answers
a chat request with a 400 naming the missing template; --chat-template FILE replaces a model's template
(what the prompt becomes is visible in usage.prompt_tokens); a bad template file stops the start-up."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server_process import ServerProcess

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3,
        "temperature": 0}


@pytest.fixture(scope="module")
def gemma3_server():
    from radixserve.model_loader.default_model import gemma3_270m_path

    yield from ServerProcess(["--model-path", gemma3_270m_path(), "--max-total-tokens", "2048",
                              "--context-length", "512"]).running()


def test_base_model_without_template(gemma3_server) -> None:
    url = gemma3_server.base_url
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "no chat template" in err["message"] and "--chat-template" in err["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "The capital of France is",
                                                   "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_chat_template_file_replaces_the_models(tmp_path, default_model_path) -> None:
    from radixserve.model_loader import get_tokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    srv = ServerProcess(["--chat-template", str(template), "--max-total-tokens", "2048"])
    for s in srv.running():
        r = httpx.post(s.base_url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        expected = get_tokenizer(default_model_path)("[user] Hi there\n[assistant]").input_ids
        assert r.json()["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("content", ["", "{% for x in %}", None])
def test_bad_template_file_stops_the_start(tmp_path, content) -> None:
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "radixserve", "generate", "--chat-template", str(path),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "ServerArgs.chat_template" in proc.stderr
