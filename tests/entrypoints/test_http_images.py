"""Images over HTTP: OpenAI chat content parts `image_url` (data: URIs; local files under
--allowed-local-media-path; remote URLs refused) on a tiny random LLaVA, checked against transformers; every
bad image is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch

from tests.models.test_llava_engine import IMAGE_TOKEN, NEW, SPAN, image, make_tiny_llava
from tests.server_process import ServerProcess

# llava-1.5's template, with SmolLM2's `<jupyter_start>` (id IMAGE_TOKEN) as the image placeholder
TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}{% for item in message['content'] %}"
            "{% if item['type'] == 'image' %}<jupyter_start>{% else %}{{ item['text'] }}{% endif %}{% endfor %}"
            "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def data_uri(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("llava-http")
    make_tiny_llava(root / "hf")
    (root / "template.jinja").write_text(TEMPLATE)
    media = root / "media"
    media.mkdir()
    image(3).save(media / "three.png")
    srv = ServerProcess(["--model-path", str(root / "hf"), "--tokenizer-path", default_model_path, "--chat-template",
                         str(root / "template.jinja"), "--quantization", "none", "--dtype", "float32",
                         "--max-total-tokens", "2048", "--allowed-local-media-path", str(media),
                         "--max-images-per-request", "3"])
    for s in srv.running():
        yield s, root


def test_chat_with_images_equals_transformers(llava_server, tokenizer) -> None:
    import transformers

    srv, root = llava_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    a, b = image(1), image(2, (64, 48))
    content = [{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": data_uri(a)}},
               {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": data_uri(b, "JPEG")}}]
    resp = client.chat.completions.create(model="hf", messages=[{"role": "user", "content": content}],
                                          max_tokens=NEW, temperature=0)
    # the oracle: the same rendered prompt and decoded images through transformers
    model = transformers.LlavaForConditionalGeneration.from_pretrained(root / "hf", dtype=torch.float32).eval()
    proc = transformers.CLIPImageProcessorPil.from_pretrained(root / "hf")
    from PIL import Image

    jpeg = Image.open(io.BytesIO(base64.b64decode(data_uri(b, "JPEG").split(",", 1)[1]))).convert("RGB")
    ids = tokenizer.encode("USER: compare<jupyter_start>and<jupyter_start>\nASSISTANT:")
    expanded = [t for x in ids for t in ([IMAGE_TOKEN] * SPAN if x == IMAGE_TOKEN else [x])]
    with torch.no_grad():
        out = model.generate(torch.tensor([expanded]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             pixel_values=proc(images=[a, jpeg], return_tensors="pt")["pixel_values"])
    want = out[0, len(expanded):].tolist()
    if 2 in want:  # SmolLM2's <|im_end|> stops the server's request
        want = want[: want.index(2)]
    tokenized = httpx.post(srv.base_url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()
    assert tokenized["count"] == len(expanded) and tokenized["tokens"] == expanded  # images counted, as the image token
    assert want and resp.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(expanded)  # image tokens count


def test_local_files_only_under_the_allowed_directory(llava_server) -> None:
    srv, root = llava_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")

    def ask(url: str):
        return client.chat.completions.create(model="hf", max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])

    assert ask(f"file://{root}/media/three.png").choices[0].finish_reason == "length"
    assert ask(str(root / "media" / "three.png")).usage.prompt_tokens > SPAN
    for url, why in [(str(root / "template.jinja"), "allowed"), (f"{root}/media/../template.jinja", "allowed"),
                     ("http://127.0.0.1:9/x.png", "remote"), ("data:image/png;base64,%%%", "base64"),
                     ("data:text/plain;base64,aGVsbG8=", "image"),
                     (data_uri(image(1))[:200], "image 0")]:  # a truncated PNG
        with pytest.raises(openai.BadRequestError) as e:
            ask(url)
        assert why in str(e.value), (url, str(e.value))
    with pytest.raises(openai.BadRequestError, match="at most 3"):
        client.chat.completions.create(model="hf", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(image(1))}}] * 4}])
    with pytest.raises(openai.BadRequestError, match="image_url.url"):
        client.chat.completions.create(model="hf", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {}}]}])
    bad = httpx.post(srv.base_url + "/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image(1))[:200]}}]}]})
    assert bad.status_code == 400 and "image 0" in bad.json()["error"]["message"]
    assert srv.alive()
    assert ask(data_uri(image(5))).choices[0].finish_reason == "length"


def test_anthropic_responses_and_ollama_images_equal_the_chat_route(llava_server) -> None:
    import anthropic
    import ollama

    srv, _ = llava_server
    img = image(4, (33, 70))
    uri = data_uri(img)
    b64 = uri.split(",", 1)[1]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="hf", max_tokens=NEW, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "what"}]}]).choices[0].message.content
    assert chat
    msg = anthropic.Anthropic(base_url=srv.base_url, api_key="none").messages.create(
        model="hf", max_tokens=NEW, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": "what"}]}])
    assert msg.content[0].text == chat
    resp = client.responses.create(model="hf", max_output_tokens=NEW, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": uri}, {"type": "input_text", "text": "what"}]}])
    assert resp.output_text == chat
    out = ollama.Client(host=srv.base_url).chat(model="hf", messages=[{"role": "user", "content": "what",
                                                                        "images": [b64]}],
                                                 options={"num_predict": NEW, "temperature": 0})
    assert out.message.content == chat


def test_tools_and_structured_output_after_an_image(llava_server) -> None:
    """The tool instructions join a vision template's content parts; a grammar constrains the answer to an image."""
    import json

    srv, _ = llava_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image(6))}}, {"type": "text", "text": "is it red?"}]
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]
    first = client.chat.completions.create(model="hf", max_tokens=4, temperature=0, tools=tools, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": parts}])
    assert first.usage.prompt_tokens > SPAN  # the image, the instructions and the text all in the prompt
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "red"}]
    assert client.chat.completions.create(model="hf", max_tokens=4, temperature=0, tools=tools,
                                          messages=history).choices[0].finish_reason in ("length", "stop", "tool_calls")
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    out = client.chat.completions.create(model="hf", max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": parts}], response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}})
    assert json.loads(out.choices[0].message.content)["answer"] in ("yes", "no")


def test_tool_instructions_join_content_parts() -> None:
    from radixserve.function_call.tool_prompt import render_for_template

    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
            {"role": "tool", "content": "red", "tool_call_id": "c1"}]
    out, extra = render_for_template(msgs, tools, native=False)
    assert extra == {} and all(isinstance(m["content"], list) for m in out)
    system = out[0]["content"]
    assert system[0] == {"type": "text", "text": "be brief"} and "look" in system[1]["text"]
    assert out[1]["content"] == msgs[1]["content"]  # the image part stays where it was
    assert "look" in out[2]["content"][0]["text"] and "red" in out[3]["content"][0]["text"]


def _tower_runs(srv) -> float:
    import re

    text = httpx.get(srv.base_url + "/metrics").text
    m = re.search(r"^radixserve:mm_encoder_runs\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert m, "no mm_encoder_runs in /metrics"
    return float(m.group(1))


def test_streamed_answers_and_the_tower_runs_once_per_new_image(llava_server) -> None:
    """Streamed and not, the same text; the same image again is a radix hit that runs no tower (/metrics), a new
    image runs it once; a decompression bomb is a 400 before any pixel is decoded."""
    import zlib

    srv, _ = llava_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    img = image(11, (45, 61))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(img)}},
                                             {"type": "text", "text": "go"}]}]
    before = _tower_runs(srv)
    whole = client.chat.completions.create(model="hf", max_tokens=NEW, temperature=0, messages=messages)
    assert _tower_runs(srv) == before + 1
    chunks = client.chat.completions.create(model="hf", max_tokens=NEW, temperature=0, messages=messages,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for c in chunks:
        text += "".join(ch.delta.content or "" for ch in c.choices)
        usage = c.usage or usage
    assert text == whole.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens >= SPAN  # the image's span came from the radix cache
    assert _tower_runs(srv) == before + 1  # ... so the tower did not run again
    # a PNG whose header declares 30000 x 30000 pixels, with a few bytes of data: refused from the header
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    uri = "data:image/png;base64," + base64.b64encode(bomb).decode()
    with pytest.raises(openai.BadRequestError, match="pixels"):
        client.chat.completions.create(model="hf", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}]}])
    assert srv.alive()
