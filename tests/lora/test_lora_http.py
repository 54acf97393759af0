"""LoRA over HTTP on a real server (tiny Llama, exact mode, 4 peft adapters): /generate lora_path, the OpenAI
`model` names, /v1/models, dynamic load / unload under load, and every bad input followed by a request that
still succeeds."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.lora.lora_driver import reference
from tests.lora.peft_adapters import make_adapter, peft_reference
from tests.server_process import ServerProcess

N = 6  # new tokens per request


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 49000) for _ in range(n)] for n in (6, 9, 14)]


@pytest.fixture(scope="module")
def refs(tiny_hf, tiny_adapters, prompts) -> dict:
    _, base = tiny_hf
    models = {None: base} | {n: peft_reference(base, p) for n, p in tiny_adapters.items()}
    return {(n, i): reference(m, p, N)[0] for n, m in models.items() for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def lora_root(tiny_adapters, tmp_path_factory) -> str:
    """--lora-dir: a copy of adapter d under another name (loaded at run time), and room for bad ones."""
    root = str(tmp_path_factory.mktemp("lora-dir"))
    shutil.copytree(tiny_adapters["d"], os.path.join(root, "d2"))
    return root


@pytest.fixture(scope="module")
def srv(tiny_hf, tiny_adapters, default_model_path, lora_root):
    path, _ = tiny_hf
    args = ["--model-path", path, "--tokenizer-path", default_model_path, "--dtype", "float32",
            "--quantization", "none", "--max-total-tokens", "8192", "--check-invariants", "--served-model-name",
            "tiny", "--max-loras-per-batch", "4", "--max-loaded-loras", "6", "--max-lora-rank", "16",
            "--lora-dir", lora_root, "--lora-paths", *(f"{n}={p}" for n, p in tiny_adapters.items())]
    yield from ServerProcess(args).running()


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.base_url, timeout=300) as c:
        yield c


def gen(http: httpx.Client, ids: list[int], lora: str | None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    return http.post("/generate", json=body)


def assert_normal_request_works(http, prompts, refs) -> None:
    r = gen(http, prompts[0], "a")
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs[("a", 0)]


def test_generate_and_openai_names_select_adapters(http, prompts, refs):
    for name in ("a", "b", "c", "d", None):
        r = gen(http, prompts[1], name)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == refs[(name, 1)], name
    # OpenAI: model "adapter" and "base:adapter" (vLLM's convention); the base by its served name
    for model, name in (("b", "b"), ("tiny:c", "c"), ("tiny", None), ("default", None)):
        r = http.post("/v1/completions", json={"model": model, "prompt": prompts[2], "max_tokens": N,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        want = http.post("/generate", json={"input_ids": prompts[2], "lora_path": name, "sampling_params": {
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True}}).json()["text"]
        assert r.json()["choices"][0]["text"] == want, model
    models = http.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in models}
    assert {"tiny", "a", "b", "c", "d"} <= by_id.keys() and by_id["a"]["parent"] == "tiny"


def test_unknown_adapter_is_a_404_naming_it(http, prompts, refs):
    r = gen(http, prompts[0], "nope")
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny:nope2", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "nope2" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "zzz", "prompt": "hi"})
    assert r.status_code == 404
    assert_normal_request_works(http, prompts, refs)


@pytest.mark.parametrize("name", ["../a", "x/y", "..", "a..b", "", "é"])
def test_bad_adapter_names_are_400(http, prompts, refs, name):
    r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": "d2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert http.post("/unload_lora_adapter", json={"lora_name": name}).status_code == 400
    assert_normal_request_works(http, prompts, refs)


def _write(folder: str, files: dict[str, bytes]) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return folder


def _bad_adapters(root: str, good: str) -> dict[str, tuple[str, str]]:
    """name -> (folder, a phrase the error must contain)."""
    with open(os.path.join(good, "adapter_config.json"), "rb") as f:
        cfg = json.load(f)
    with open(os.path.join(good, "adapter_model.safetensors"), "rb") as f:
        weights = f.read()
    header_len = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8 : 8 + header_len])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] += 10**6  # lying: a tensor said to extend far past the data
    lying_header = json.dumps(header).encode()
    lying = len(lying_header).to_bytes(8, "little") + lying_header + weights[8 + header_len :]
    cfg_bytes = json.dumps(cfg).encode()
    out = {
        "truncated": (_write(f"{root}/truncated", {"adapter_config.json": cfg_bytes,
                                                    "adapter_model.safetensors": weights[: len(weights) // 2]}),
                      "unreadable"),
        "lying": (_write(f"{root}/lying", {"adapter_config.json": cfg_bytes, "adapter_model.safetensors": lying}),
                  "unreadable"),
        "bigrank": (_write(f"{root}/bigrank", {"adapter_config.json": json.dumps({**cfg, "r": 64}).encode(),
                                               "adapter_model.safetensors": weights}), "over --max-lora-rank"),
        "nomodule": (_write(f"{root}/nomodule", {"adapter_config.json": json.dumps(
            {**cfg, "target_modules": ["q_proj", "fc_in"]}).encode(), "adapter_model.safetensors": weights}),
            "fc_in"),
        "badjson": (_write(f"{root}/badjson", {"adapter_config.json": b"{not json",
                                               "adapter_model.safetensors": weights}), "not valid JSON"),
    }
    # adapters of other Llamas: a narrower one (shapes differ: the error names the tensor) and a deeper
    # one (its layer 2 is a module this 2-layer model lacks)
    import transformers

    for name, hidden, layers, phrase in (("shapes", 32, 2, "model.layers.0.self_attn.q_proj.lora_A.weight"),
                                         ("deeper", 64, 3, "model.layers.2.self_attn.q_proj")):
        cfg_other = transformers.LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=128,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
        make_adapter(transformers.LlamaForCausalLM(cfg_other), f"{root}/{name}", seed=9, r=4, targets=["q_proj"])
        out[name] = (f"{root}/{name}", phrase)
    return out


def test_bad_adapters_are_clear_errors_and_the_server_goes_on(http, prompts, refs, lora_root, tiny_adapters):
    bad = _bad_adapters(lora_root, tiny_adapters["a"])
    for name, (folder, phrase) in bad.items():
        r = http.post("/load_lora_adapter", json={"lora_name": f"bad-{name}", "lora_path": folder})
        assert r.status_code == 400, (name, r.text)
        msg = r.json()["error"]["message"]
        assert f"bad-{name}" in msg and phrase in msg, (name, msg)
        assert gen(http, prompts[0], f"bad-{name}").status_code == 404  # nothing half-registered
        assert_normal_request_works(http, prompts, refs)
    r = http.post("/load_lora_adapter", json={"lora_name": "missing", "lora_path": "no-such-folder"})
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "outside", "lora_path": tiny_adapters["a"]})
    assert r.status_code == 400 and "outside --lora-dir" in r.json()["error"]["message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "d2"})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404
    assert_normal_request_works(http, prompts, refs)


def test_load_and_unload_under_load(http, srv, prompts, refs):
    """200 requests over a, b, c, d while d is unloaded (with some of its requests running) and d2 (d's
    weights) loaded: no 5xx; each answer is its adapter's output, or a 404 for d after its unload / d2 before
    its load; the unload returns only after d's running requests finished; no KV left in use."""
    import time

    plan = ["d"] * 12 + [("a", "b", "c", "d", "d2")[i % 5] for i in range(188)]
    results: list[tuple[str, int, int, list[int] | None, float]] = [None] * len(plan)  # type: ignore[list-item]
    some_done = threading.Semaphore(0)

    def one(i: int) -> None:
        name, p = plan[i], i % len(prompts)
        with httpx.Client(base_url=srv.base_url, timeout=300) as c:
            r = gen(c, prompts[p], name)
        results[i] = (name, p, r.status_code, r.json().get("output_ids") if r.status_code == 200 else None,
                      time.monotonic())
        some_done.release()

    streaming = threading.Event()
    long_d: dict[str, float | int] = {}

    def long_running_d() -> None:
        """A long d request, streamed: once its first chunk is here it is running, so the unload must wait for it
        (the short ones may all have finished together by then)."""
        body = {"input_ids": prompts[0], "stream": True, "lora_path": "d",
                "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", srv.base_url + "/generate", json=body, timeout=300) as r:
            long_d["status"] = r.status_code
            for _ in r.iter_lines():
                streaming.set()
        long_d["done"] = time.monotonic()
        streaming.set()

    with ThreadPoolExecutor(17) as pool:
        long_fut = pool.submit(long_running_d)
        futs = [pool.submit(one, i) for i in range(len(plan))]
        for _ in range(3):
            some_done.acquire()  # a few answered: the first d requests are running or queued now
        streaming.wait(120)
        unload_sent = time.monotonic()
        unload = http.post("/unload_lora_adapter", json={"lora_name": "d"})
        unload_done = time.monotonic()
        load = http.post("/load_lora_adapter", json={"lora_name": "d2", "lora_path": "d2"})
        for f in [long_fut, *futs]:
            f.result()
    assert long_d["status"] == 200 and unload_sent < long_d["done"] <= unload_done + 0.5, (long_d, unload_sent)
    assert unload.status_code == 200 and unload.json()["in_flight_requests"] == 0, unload.text
    assert load.status_code == 200, load.text
    codes: dict[tuple[str, int], int] = {}
    for name, p, status, ids, done in results:
        codes[(name, status)] = codes.get((name, status), 0) + 1
        assert status in (200, 404), (name, status)
        if status == 200:
            assert ids == refs[("d" if name == "d2" else name, p)], name
            if name == "d":  # (its answer may still be on the wire when the scheduler says "no users")
                assert done <= unload_done + 0.5, "the unload returned before a request using d finished"
        else:
            assert name in ("d", "d2")
    print("load/unload under load:", codes)
    assert all(codes.get((n, 200), 0) == plan.count(n) for n in "abc"), codes
    assert codes.get(("d", 200), 0) > 0 and codes.get(("d", 404), 0) > 0, codes
    assert gen(http, prompts[0], "d").status_code == 404
    assert gen(http, prompts[0], "d2").json()["output_ids"] == refs[("d", 0)]
    info = http.get("/get_server_info").json()
    assert info["num_used_tokens"] == 0 and info["num_running_reqs"] == 0, info
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/get_server_info").json()["num_cached_tokens"] == 0
    models = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert "d2" in models and "d" not in models
