"""The playground's image button on a vision-language model (a tiny random LLaVA): attach two images, send, and
the answer equals what the chat route gives the same image_url parts; the thumbnails show in the message, and a
second turn resends the images (its prompt comes from the radix cache)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import API_KEY
from tests.entrypoints.test_http_images import TEMPLATE, data_uri
from tests.models.test_llava_engine import SPAN, image, make_tiny_llava
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def web_server(tmp_path_factory, default_model_path) -> Iterator[ServerProcess]:
    """Overrides conftest's: the page talks to a LLaVA server."""
    root = tmp_path_factory.mktemp("llava-web")
    make_tiny_llava(root / "hf")
    (root / "template.jinja").write_text(TEMPLATE)
    srv = ServerProcess(["--model-path", str(root / "hf"), "--tokenizer-path", default_model_path, "--chat-template",
                         str(root / "template.jinja"), "--quantization", "none", "--dtype", "float32",
                         "--max-total-tokens", "4096", "--api-key", API_KEY, "--check-invariants"], api_key=API_KEY)
    yield from srv.running()


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_attached_images_reach_the_model(page: Any, api: httpx.Client) -> None:
    a, b = image(1), image(2, (64, 48))
    page.fill("#p-temperature", "0")
    page.fill("#p-max_tokens", "6")
    page.set_input_files("#chat-image", files=[{"name": "a.png", "mimeType": "image/png", "buffer": _png(a)},
                                                {"name": "b.png", "mimeType": "image/png", "buffer": _png(b)}])
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 2")
    page.fill("#chat-input", "compare")
    page.click("#send")
    page.wait_for_selector(".msg-assistant[data-state=done] .usage")
    assert page.locator("#attachments").is_hidden()  # sent: nothing pending
    assert page.locator(".msg-user .images img").count() == 2
    answer = page.locator(".msg-assistant .content").last.inner_text()
    usage = page.locator(".msg-assistant .usage").last
    prompt = int(usage.get_attribute("data-prompt-tokens"))
    # the same message through the chat route: the page sent the images, in order, as image_url parts
    parts = [{"type": "image_url", "image_url": {"url": data_uri(a)}},
             {"type": "image_url", "image_url": {"url": data_uri(b)}}, {"type": "text", "text": "compare"}]
    ref = api.post("/v1/chat/completions", json={"model": "default", "max_tokens": 6, "temperature": 0,
                                                 "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                              {"role": "user", "content": parts}]}).json()
    assert answer == ref["choices"][0]["message"]["content"]
    assert prompt == ref["usage"]["prompt_tokens"] and prompt > 2 * SPAN
    # a second turn sends the images again: the first turn's prompt is a radix hit
    page.fill("#chat-input", "again")
    page.click("#send")
    page.wait_for_function("() => document.querySelectorAll('.msg-assistant[data-state=done] .usage').length === 2")
    second = page.locator(".msg-assistant .usage").last
    assert int(second.get_attribute("data-cached-tokens")) >= prompt - 1
