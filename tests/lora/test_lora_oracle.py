"""Per-request LoRA adapters against transformers + peft (float32, exact mode) on the tiny Llama."""

from __future__ import annotations

import random

import pytest

from tests.lora.lora_driver import assert_matches, reference, run
from tests.lora.peft_adapters import peft_reference


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(10, 49000) for _ in range(n)] for n in (5, 11, 23, 37)]


@pytest.fixture(scope="module")
def refs(tiny_hf, tiny_adapters, prompts):
    """(adapter or None, prompt index) -> reference tokens and logprobs."""
    _, base = tiny_hf
    models = {None: base} | {name: peft_reference(base, path) for name, path in tiny_adapters.items()}
    return {(name, i): reference(m, p) for name, m in models.items() for i, p in enumerate(prompts)}


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_each_adapter_alone_matches_peft(make_lora_scheduler, prompts, refs, name):
    sched = make_lora_scheduler()
    out = run(sched, {f"r{i}": (p, name) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        assert_matches(out[f"r{i}"], refs[(name, i)], what=f"{name} prompt {i}")
    assert refs[(name, 0)] != refs[(None, 0)]  # the adapter changes the output (B is not zero)


def test_four_adapters_and_base_in_one_batch(make_lora_scheduler, prompts, refs):
    sched = make_lora_scheduler()
    names = [None, "a", "b", "c", "d"]
    reqs = {f"{n}-{i}": (p, n) for n in names for i, p in enumerate(prompts)}
    steps = []
    orig = sched.model_runner.forward_batch_generation

    def spy(batch):
        steps.append(set(batch.lora_uids or [0] * batch.batch_size))
        return orig(batch)

    sched.model_runner.forward_batch_generation = spy
    out = run(sched, reqs)
    for n in names:
        for i in range(len(prompts)):
            assert_matches(out[f"{n}-{i}"], refs[(n, i)], what=f"{n} prompt {i}")
    # one prefill step and the decode steps served every adapter and the base together
    assert max(len(s) for s in steps) == 5


def test_chunked_prefill_under_adapters(make_lora_scheduler, prompts, refs):
    sched = make_lora_scheduler(chunked_prefill_size=8)
    out = run(sched, {f"{n}-3": (prompts[3], n) for n in ("a", "c", None)})
    for n in ("a", "c", None):
        assert_matches(out[f"{n}-3"], refs[(n, 3)], what=f"{n} chunked")


def test_radix_hits_stay_within_an_adapter(make_lora_scheduler, prompts, refs):
    sched = make_lora_scheduler()
    p = prompts[3]
    first = run(sched, {"a1": (p, "a")})
    assert first["a1"].meta["cached_tokens"] == 0
    # same prompt, same adapter: a radix hit, same answer
    again = run(sched, {"a2": (p, "a")})
    assert again["a2"].meta["cached_tokens"] > 0
    assert_matches(again["a2"], refs[("a", 3)], what="a radix hit")
    # same prompt under another adapter or the base: nothing of a's prefix is reused
    other = run(sched, {"b1": (p, "b"), "base1": (p, None)})
    assert other["b1"].meta["cached_tokens"] == 0 and other["base1"].meta["cached_tokens"] == 0
    assert_matches(other["b1"], refs[("b", 3)], what="b after a")
    assert_matches(other["base1"], refs[(None, 3)], what="base after a")


def test_no_cross_talk_same_prompt_three_ways(make_lora_scheduler, prompts, refs):
    sched = make_lora_scheduler()
    p = prompts[2]
    out = run(sched, {"A": (p, "a"), "B": (p, "b"), "base": (p, None)})
    assert len({tuple(out[k].ids) for k in out}) == 3
    for rid, n in (("A", "a"), ("B", "b"), ("base", None)):
        assert_matches(out[rid], refs[(n, 2)], what=rid)
        assert out[rid].meta["cached_tokens"] == 0


def test_unknown_adapter_is_a_404_naming_it_and_the_next_request_runs(make_lora_scheduler, prompts, refs):
    sched = make_lora_scheduler()
    out = run(sched, {"x": (prompts[0], "nope")})
    assert out["x"].error[0] == 404 and "'nope'" in out["x"].error[1]
    assert_matches(run(sched, {"ok": (prompts[0], "a")})["ok"], refs[("a", 0)], what="after 404")


def test_batch_cap_and_lru_keep_outputs_exact(make_lora_scheduler, prompts, refs):
    """--max-loras-per-batch 2 over 4 adapters with only 2 in memory: requests wait their turn (never more
    than 2 adapters in a step), adapters are re-read after eviction, and every output is still exact."""
    sched = make_lora_scheduler(max_loras_per_batch=2, max_loaded_loras=2)
    steps = []
    orig = sched.model_runner.forward_batch_generation

    def spy(batch):
        steps.append({u for u in (batch.lora_uids or []) if u})
        return orig(batch)

    sched.model_runner.forward_batch_generation = spy
    names = ["a", "b", "c", "d"]
    out = run(sched, {f"{n}-{i}": (p, n) for n in names for i, p in enumerate(prompts[:2])} | {"base": (prompts[0], None)})
    for n in names:
        for i in range(2):
            assert_matches(out[f"{n}-{i}"], refs[(n, i)], what=f"{n} prompt {i} under the cap")
    assert_matches(out["base"], refs[(None, 0)], what="base under the cap")
    assert max(len(s) for s in steps) == 2
    manager = sched.model_runner.lora_manager
    assert len(manager.loaded) <= 2 and all(r.pins == 0 and r.refs == 0 for r in manager.regs.values())


def test_ngram_speculative_verify_uses_the_requests_adapter(make_lora_scheduler, prompts, refs):
    """The verify forward runs each request's adapter: greedy outputs equal peft's, drafts or not."""
    sched = make_lora_scheduler(speculative_algorithm="ngram")
    rep = prompts[1] * 3  # repeated text: the n-gram drafter proposes tokens
    ref_a = refs[("a", 1)]
    out = run(sched, {"a": (prompts[1], "a"), "b": (prompts[2], "b"), "a-rep": (rep, "a"), "base": (rep, None)})
    assert_matches(out["a"], ref_a, what="a with ngram")
    assert_matches(out["b"], refs[("b", 2)], what="b with ngram")
    assert len({tuple(out["a-rep"].ids), tuple(out["base"].ids)}) == 2


def test_structured_output_under_an_adapter(make_lora_scheduler, prompts, refs):
    """A grammar constrains an adapter's tokens as it does the base model's (the mask is per request)."""
    from radixserve.managers.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling.sampling_params import SamplingParams

    sched = make_lora_scheduler()
    tok = sched.tokenizer
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, regex="[0-9]{3}")
    assert sched.add_request(TokenizedGenerateReqInput("s", prompts[0], sp, lora_path="a")) is None
    ids = []
    while sched.has_work():
        for o in sched.step():
            ids.extend(o.new_token_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    assert len(text) == 3 and text.isdigit(), text
