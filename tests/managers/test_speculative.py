"""--speculative-algorithm ngram through the real Scheduler: greedy output is token for token what
plain decoding gives (exact mode, the default low-bit mode, batches), the stop rules hold inside an
accepted run, only verified tokens stay in the KV and the radix cache (--check-invariants accounts
every slot after every step), and requests that cannot take part decode as before."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams

REPEAT = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, "
          "mango. Now the list again: apple, banana, cherry,")
OTHER = ["Once upon a time", "The quick brown fox jumps over the lazy dog. The quick brown fox",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]


def _run(sched, prompts: dict[str, list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], dict]:
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    metas: dict[str, dict] = {}
    for rid, ids in prompts.items():
        assert sched.add_request(TokenizedGenerateReqInput(rid, ids, params)) is None
    while sched.has_work():
        for o in sched.step():
            outs[o.rid].extend(o.new_token_ids)
            if o.finished_reason is not None:
                metas[o.rid] = o.meta_info
    return outs, metas


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    return {f"p{i}": tokenizer.encode(t, add_special_tokens=False) for i, t in enumerate([REPEAT, *OTHER])}


def _pair(runner, **overrides):
    """(plain scheduler, speculative scheduler) on the same weights, invariant checks on."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    args = runner.server_args.replace(check_invariants=True, **overrides)
    spec = args.replace(speculative_algorithm="ngram")
    return (Scheduler(args, model_runner=ModelRunner(args, model=runner.model)),
            Scheduler(spec, model_runner=ModelRunner(spec, model=runner.model)))


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_greedy_output_is_identical_alone_and_batched(mode, model_runner, fast_runner, prompts) -> None:
    runner = model_runner if mode == "exact" else fast_runner
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    for subset in (["p0"], ["p3"], list(prompts)):
        plain, spec = _pair(runner)
        want, _ = _run(plain, {k: prompts[k] for k in subset}, params)
        got, metas = _run(spec, {k: prompts[k] for k in subset}, params)
        assert got == want, subset
        if subset == ["p0"]:
            m = metas["p0"]
            assert m["spec_verify_ct"] >= 3 and m["spec_accept_length"] > 1.5, m
            assert spec.get_server_info()["spec_accept_length"] > 1.5


def test_stop_rules_hold_inside_an_accepted_run(fast_runner, prompts, tokenizer) -> None:
    base = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain, spec = _pair(fast_runner)
    want, _ = _run(plain, {"p0": prompts["p0"]}, base)
    text = tokenizer.decode(want["p0"])
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # a string the output reaches mid-way
    for params in (SamplingParams(temperature=0.0, max_new_tokens=7),
                   SamplingParams(temperature=0.0, max_new_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[want["p0"][9]])):
        plain, spec = _pair(fast_runner)
        a, ma = _run(plain, {"p0": prompts["p0"]}, params)
        b, mb = _run(spec, {"p0": prompts["p0"]}, params)
        assert a == b and ma["p0"]["finish_reason"] == mb["p0"]["finish_reason"], params
        assert len(b["p0"]) <= params.max_new_tokens


def test_requests_that_cannot_take_part_decode_as_before(fast_runner, prompts) -> None:
    for params in (SamplingParams(temperature=0.7, max_new_tokens=16, seed=3),
                   SamplingParams(temperature=0.0, max_new_tokens=16, frequency_penalty=0.5),
                   SamplingParams(temperature=0.0, max_new_tokens=16, logit_bias={11: 2.0})):
        plain, spec = _pair(fast_runner)
        a, _ = _run(plain, {"p0": prompts["p0"]}, params)
        b, mb = _run(spec, {"p0": prompts["p0"]}, params)
        assert a == b and "spec_verify_ct" not in mb["p0"], params


def test_small_pool_and_aborts_leak_nothing(model_runner, prompts) -> None:
    # a pool too small for every request's drafts: verification is skipped or requests retract;
    # the invariant checker accounts every slot after each step, and the pool ends empty but the tree
    plain, spec = _pair(model_runner, max_total_tokens=160, max_running_requests=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    short = {k: v[:30] for k, v in prompts.items()}
    want, _ = _run(plain, short, params)
    got, _ = _run(spec, short, params)
    assert got == want
    spec.add_request(TokenizedGenerateReqInput("gone", prompts["p0"], SamplingParams(temperature=0.0, max_new_tokens=40)))
    for _ in range(4):
        spec.step()
    spec.abort_request("gone")
    while spec.has_work():
        spec.step()
    info = spec.get_server_info()
    assert info["num_used_tokens"] == 0 and info["num_running_reqs"] == 0


def test_server_args_bounds() -> None:
    from radixserve.server_args import ServerArgs

    ServerArgs(speculative_algorithm="ngram")
    for kw, field in (({"speculative_algorithm": "draft_model"}, "speculative_algorithm"),
                      ({"speculative_algorithm": "eagle9"}, "speculative_algorithm"),
                      ({"speculative_algorithm": "ngram", "page_size": 4}, "speculative_algorithm"),
                      ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                      ({"speculative_num_draft_tokens": 10**9}, "speculative_num_draft_tokens"),
                      ({"speculative_ngram_max_match_window": 10**6}, "speculative_ngram_min_match_window"),
                      ({"speculative_ngram_min_match_window": 0}, "speculative_ngram_min_match_window")):
        with pytest.raises(ValueError, match=field):
            ServerArgs(**kw)
