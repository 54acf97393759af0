"""The offline Engine end to end: a real scheduler process over ZMQ, the real model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

import radixserve
from radixserve.debug.inspect import inspect_trace

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace") / "steps.jsonl")


@pytest.fixture(scope="module")
def engine(trace_path):
    with radixserve.Engine(check_invariants=True, max_total_tokens=16384, trace_batches=trace_path) as e:
        yield e


def greedy(n: int = 16, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **kw}


def test_single_batch_and_meta(engine):
    one = engine.generate("The capital of France is", greedy(8))
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert len(one["output_ids"]) == 8
    assert one["text"] == engine.tokenizer.decode(one["output_ids"])
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert meta["completion_tokens"] == 8 and meta["finish_reason"]["type"] == "length"
    assert meta["e2e_latency"] > 0
    batch = engine.generate(["The capital of France is", "1, 2, 3,"], greedy(8))
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    by_ids = engine.generate(input_ids=engine.tokenizer.encode("1, 2, 3,"), sampling_params=greedy(8))
    assert by_ids["output_ids"] == batch[1]["output_ids"]


def test_stream_sync_and_async(engine):
    full = engine.generate("Write a haiku about the sea.", greedy(24))
    chunks = list(engine.generate("Write a haiku about the sea.", greedy(24), stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]

    async def go():
        res = await engine.async_generate(["Write a haiku about the sea.", "Hi"], greedy(24))
        parts = []
        async for c in await engine.async_generate("Write a haiku about the sea.", greedy(24), stream=True):
            parts.append(c["text"])
        return res, "".join(parts)

    res, streamed = asyncio.run(go())
    assert res[0]["text"] == full["text"] and streamed == full["text"]


def test_stop_string_spanning_two_tokens_is_trimmed(engine):
    prompt = "Once upon a time, there was a little"
    ref = engine.generate(prompt, greedy(24))
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in ref["output_ids"]]
    j = next(i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1]) >= 2)
    prefix = tok.decode(ref["output_ids"][:j])
    stop = pieces[j][-2:] + pieces[j + 1][:2]  # spans the boundary between token j and j+1
    out = engine.generate(prompt, greedy(24, stop=[stop]))
    full = tok.decode(ref["output_ids"])
    assert out["text"] == full[: full.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(prefix) <= len(out["text"]) + 4
    kept = engine.generate(prompt, greedy(24, stop=[stop], no_stop_trim=True))
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_stop_token_ids_and_max_new_tokens(engine):
    prompt = "Count slowly: one, two, three, four,"
    ref = engine.generate(prompt, greedy(16))
    target = ref["output_ids"][4]
    first = ref["output_ids"].index(target)
    out = engine.generate(prompt, greedy(16, stop_token_ids=[target]))
    assert out["output_ids"] == ref["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["text"] == engine.tokenizer.decode(ref["output_ids"][:first])  # the stop token is trimmed
    assert len(engine.generate(prompt, greedy(3))["output_ids"]) == 3
    zero = engine.generate(prompt, greedy(0))
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_eos_ignore_eos_and_min_new_tokens(engine):
    prompt = CHAT.format("Reply with one word: hello")
    natural = engine.generate(prompt, greedy(64))
    n = len(natural["output_ids"])
    assert natural["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2} and n < 30
    assert engine.generate(prompt, greedy(40, ignore_eos=True))["meta_info"]["completion_tokens"] == 40
    longer = engine.generate(prompt, greedy(64, min_new_tokens=n + 5))
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert 2 not in longer["output_ids"][: n + 4]


def test_same_seed_same_text(engine):
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    prompt = CHAT.format("Tell me a story about a dragon.")
    a = engine.generate(prompt, params)
    # in a batch with other sampled requests, the seeded one still draws the same tokens
    b = engine.generate([prompt, "Another prompt entirely"],
                        [params, {"max_new_tokens": 24, "temperature": 1.0}])[0]
    c = engine.generate(prompt, {**params, "seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("hello", params)


def test_bad_prompts_raise_and_concurrent_requests_finish(engine):
    async def go():
        good = [asyncio.ensure_future(engine.async_generate(f"Number {i}:", greedy(12))) for i in range(4)]
        errors = []
        for kwargs in (dict(prompt=""), dict(input_ids=[1, 2, 10**7]), dict(input_ids=[5] * 9000),
                       dict(prompt=["ok", "fine"], sampling_params=[greedy(4), {"temperature": -1}])):
            try:
                await engine.async_generate(**kwargs)
            except ValueError as e:
                errors.append(str(e))
        return await asyncio.gather(*good), errors

    good, errors = asyncio.run(go())
    assert [e.split(":")[0].split()[0] for e in errors] == ["prompt", "input_ids", "prompt", "temperature"]
    assert all(g["meta_info"]["completion_tokens"] == 12 for g in good)
    assert engine.get_server_info()["num_used_tokens"] == 0


def test_server_info_flush_and_trace(engine, trace_path):
    info = engine.get_server_info()
    for key in ("max_total_num_tokens", "num_used_tokens", "num_cached_tokens", "num_running_reqs",
                "num_waiting_reqs", "cache_hit_rate"):
        assert key in info
    assert info["num_cached_tokens"] > 0 and info["num_used_tokens"] == 0
    assert engine.flush_cache() is True
    assert engine.get_server_info()["num_cached_tokens"] == 0
    lines = [json.loads(x) for x in open(trace_path)]
    assert lines and {"schedule", "forward", "result"} <= set(lines[0])
    modes = {x["forward"]["forward_mode"] for x in lines}
    assert {"PREFILL", "DECODE"} <= modes
    summary = inspect_trace(trace_path, limit=2)
    assert summary["steps"] == len(lines)
    proc = subprocess.run([sys.executable, "-m", "radixserve", "inspect", trace_path, "--limit", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "step 0:" in proc.stdout and "forward:" in proc.stdout


def test_large_batch_shows_progress_bar(engine, capfd):
    outs = engine.generate([f"Item {i}:" for i in range(20)], greedy(2))
    assert len(outs) == 20
    assert "generate" in capfd.readouterr().err


def test_show_progress_draws_a_bar_for_large_batches_only(engine, capfd):
    from radixserve.entrypoints.engine import PROGRESS_BAR_MIN_BATCH

    prompts = [f"Item {i}:" for i in range(PROGRESS_BAR_MIN_BATCH)]
    capfd.readouterr()
    engine.generate(prompts, greedy(1))
    assert "generate" in capfd.readouterr().err  # tqdm's bar, on stderr
    engine.generate(prompts[:2], greedy(1))
    assert "generate" not in capfd.readouterr().err
    # the knob is read per call: off, the same large batch draws nothing
    object.__setattr__(engine.server_args, "show_progress", False)
    try:
        engine.generate(prompts, greedy(1))
        assert "generate" not in capfd.readouterr().err
    finally:
        object.__setattr__(engine.server_args, "show_progress", True)
