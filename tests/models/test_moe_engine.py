"""The MoE architectures through the real scheduler (Engine): radix-cache hits, chunked prefill, MIXED steps
and n-gram speculative decoding (TARGET_VERIFY through the experts); every request's greedy tokens equal
transformers' generate(). The step records carry each step's expert load, /get_server_info the running
totals, and /metrics' gauges are built from them."""

from __future__ import annotations

import json

import pytest
import torch

import radixserve
from radixserve.metrics import ServerMetrics, load_imbalance
from tests.models.moe_models import E, make_moe_model

NEW = 8


@pytest.fixture(scope="module", params=["qwen2_moe", "olmoe"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model = make_moe_model(request.param, path)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 300, (20,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 9)]
    prompts.append(prefix[:6] * 3)  # repeats: the n-gram drafter has something to propose
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return str(path), prompts, refs


@pytest.mark.parametrize("args", [
    {"chunked_prefill_size": 7, "enable_mixed_chunk": True},
    {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3},
], ids=["chunked-mixed", "ngram"])
def test_engine_greedy_equals_transformers(tiny_moe, default_model_path, tmp_path, args) -> None:
    path, prompts, refs = tiny_moe
    trace = tmp_path / "trace.jsonl"
    with radixserve.Engine(model_path=path, tokenizer_path=default_model_path, max_total_tokens=2048,
                           quantization="none", dtype="float32", check_invariants=True, show_progress=False,
                           trace_batches=str(trace), **args) as eng:
        params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        first = eng.generate(input_ids=prompts[0], sampling_params=params)  # fills the radix cache
        rest = eng.generate(input_ids=prompts[1:], sampling_params=params)
        info = eng.get_server_info()
    for out, ref in zip([first, *rest], refs):
        assert out["output_ids"] == ref
    assert rest[0]["meta_info"]["cached_tokens"] >= 16
    # every step's record says how many (token, slot) pairs each expert of each layer took
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    total = [0] * E
    for step in steps:
        load = step["moe"]["expert_load"]
        assert sorted(load) == ["0", "1", "2"]
        k = 2
        assert all(sum(c) == step["forward"]["num_tokens"] * k for c in load.values())
        for c in load.values():
            total = [a + b for a, b in zip(total, c)]
    assert info["moe_expert_tokens"] == {str(e): n for e, n in enumerate(total)}
    metrics = ServerMetrics("m")
    metrics.refresh({"dp": [{"dp_rank": 0, "moe_expert_tokens": info["moe_expert_tokens"]}]})
    text = metrics.render().decode()
    assert f'radixserve:moe_expert_tokens{{dp_rank="0",expert="3",model_name="m"}} {float(total[3])}' in text
    assert "radixserve:moe_load_imbalance" in text


def test_load_imbalance() -> None:
    assert load_imbalance({"0": 5, "1": 5}) == 1.0
    assert load_imbalance({"0": 10, "1": 0, "2": 0, "3": 0}) == 4.0
    assert load_imbalance({"0": 0, "1": 0}) == 0.0
