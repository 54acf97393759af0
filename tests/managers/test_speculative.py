"""Speculative decoding through the real Scheduler, with --check-invariants (every slot of the target's pool
and of the draft model's accounted after every step): greedy output with each algorithm is token for token
what plain decoding gives on 30 prompts, alone, batched 30 at once, with a draft that is mostly rejected,
at page_size 1 and 16, with the radix cache on and off, under a pool small enough to force retraction and
with aborts mid-run; nothing leaks from either pool; stop rules hold inside an accepted run; requests with
penalties, logit_bias, min_new_tokens, logprobs and seeds take part and get what plain decoding gives.

`ngram` drafts by prompt lookup; `draft_model` uses the default model as its own draft (acceptance ~100%)
or a tiny random Llama with its vocabulary (mostly rejected)."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams

ALGOS = ["ngram", "draft_model"]
_FRUIT = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
TEXTS = (
    [f"Repeat this list exactly: {_FRUIT[i * 5:]}. Now the list again: {_FRUIT[i * 5 : i * 5 + 14]}"
     for i in range(6)]
    + [f"def f{i}(a, b):\n    return a + b * {i}\n\ndef g{i}(a, b):\n    return a - b * {i}\n\ndef h{i}(a, b):\n"
       for i in range(6)]
    + [f"Quote word for word: the meeting on day {i} starts at {i + 7} sharp in room {i * 3}. Quote: the meeting"
       for i in range(6)]
    + ["Once upon a time", "Tell me about the ocean.", "What is the best way to learn to cook?",
       "Describe a city at night.", "Why is the sky blue?", "Write a haiku about rain.",
       "List three prime numbers.", "How do bees make honey?", "Name a famous painter.",
       "What is a radix tree?", "Explain gravity to a child.", "Give me a synonym for happy."]
)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def det_runner(model_runner):
    """The default model in deterministic mode: a request's tokens do not depend on what shares its steps.
    Batched comparisons need it: in the default low-bit mode, steps of <= 4 rows run other kernels than
    longer ones, so a request's late tokens depend on when the others finish, with or without speculation
    (which changes when they finish)."""
    from radixserve.model_executor.model_runner import ModelRunner

    args = model_runner.server_args.replace(enable_deterministic_inference=True, max_total_tokens=4096)
    return ModelRunner(args, model=model_runner.model)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    assert len(TEXTS) == 30
    return {f"p{i}": tokenizer.encode(t, add_special_tokens=False) for i, t in enumerate(TEXTS)}


@pytest.fixture(scope="module")
def det_want(det_runner, prompts) -> dict[str, list[int]]:
    """Plain greedy decoding of the 30 prompts batched, in deterministic mode: what every batched run must
    give, whatever its page size, radix cache or batch composition."""
    return _run(_sched(det_runner, max_running_requests=32), prompts, GREEDY)[0]


def _sched(runner, algo: str | None = None, draft: str | None = None, **overrides):
    """A scheduler on `runner`'s weights with invariant checks on; draft_model defaults to the runner's
    own model file as its draft."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    overrides.setdefault("max_total_tokens", min(4096, runner.server_args.max_total_tokens or 4096))
    if algo == "draft_model":
        overrides["speculative_draft_model_path"] = draft or runner.model_path
    args = runner.server_args.replace(check_invariants=True, speculative_algorithm=algo, **overrides)
    return Scheduler(args, model_runner=ModelRunner(args, model=runner.model))


def _run(sched, prompts: dict[str, list[int]], params: SamplingParams | dict[str, SamplingParams],
         on_step=None, logprobs: bool = False) -> tuple[dict[str, list[int]], dict[str, dict]]:
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    metas: dict[str, dict] = {}
    for rid, ids in prompts.items():
        p = params[rid] if isinstance(params, dict) else params
        assert sched.add_request(TokenizedGenerateReqInput(rid, ids, p, return_logprob=logprobs,
                                                           top_logprobs_num=2 if logprobs else 0)) is None
    step = 0
    while sched.has_work():
        for o in sched.step():
            outs[o.rid].extend(o.new_token_ids)
            if o.finished_reason is not None:
                metas[o.rid] = {**o.meta_info, "logprobs": o.output_token_logprobs}
        if on_step is not None:
            on_step(sched, step)
        step += 1
    return outs, metas


def _alone(sched, prompts: dict[str, list[int]], params: SamplingParams):
    outs, metas = {}, {}
    for rid, ids in prompts.items():
        o, m = _run(sched, {rid: ids}, params)
        outs.update(o)
        metas.update(m)
    return outs, metas


def _assert_no_leaks(sched) -> None:
    info = sched.get_server_info()
    assert info["num_used_tokens"] == 0 and info["num_running_reqs"] == 0, info
    if "spec_draft_num_used_tokens" in info:  # the draft model's own pool
        assert info["spec_draft_num_used_tokens"] == 0, info


def test_greedy_alone_is_identical(fast_runner, prompts) -> None:
    want, _ = _alone(_sched(fast_runner), prompts, GREEDY)
    for algo in ALGOS:
        spec = _sched(fast_runner, algo)
        got, metas = _alone(spec, prompts, GREEDY)
        assert got == want, algo
        _assert_no_leaks(spec)
        mean = spec.get_server_info()["spec_accept_length"]
        # the model as its own draft is kept (nearly) always: 1 + 3 drafts per verify
        assert mean > (3.5 if algo == "draft_model" else 1.3), (algo, mean)
        assert metas["p0"]["spec_verify_ct"] > 0 and metas["p0"]["spec_accept_length"] > 1.5


def test_greedy_batched_page16_no_radix_is_identical(det_runner, det_want, prompts) -> None:
    kw = {"page_size": 16, "disable_radix_cache": True, "max_running_requests": 32}
    for algo in ALGOS:
        spec = _sched(det_runner, algo, **kw)
        got, _ = _run(spec, prompts, GREEDY)
        assert got == det_want, algo
        _assert_no_leaks(spec)
        assert spec.get_server_info()["spec_verify_ct"] > 30


def test_greedy_with_a_mostly_rejected_draft_is_identical(det_runner, det_want, prompts, tiny_llama) -> None:
    draft = tiny_llama()  # random weights, SmolLM2's vocabulary: its drafts are mostly wrong
    spec = _sched(det_runner, "draft_model", draft=draft, max_running_requests=32)
    got, _ = _run(spec, prompts, GREEDY)
    assert got == det_want
    _assert_no_leaks(spec)
    info = spec.get_server_info()
    assert info["spec_verify_ct"] > 0 and info["spec_accept_length"] < 2.0, info


def test_a_failing_verify_fails_only_its_request(fast_runner, prompts) -> None:
    """A verify forward that raises is bisected like any step: the request it is pinned on gets an error,
    the others go on unchanged, and neither pool keeps anything of it."""
    part = {rid: prompts[rid] for rid in ("p0", "p1", "p7")}
    want, _ = _run(_sched(fast_runner), part, GREEDY)
    spec = _sched(fast_runner, "draft_model")
    run_batch = spec.run_batch

    def failing(batch):
        if batch.forward_mode.is_target_verify() and any(r.rid == "p1" for r in batch.reqs):
            raise RuntimeError("injected verify failure")
        return run_batch(batch)

    spec.run_batch = failing
    got, metas = _run(spec, part, GREEDY)
    assert metas["p1"]["finish_reason"]["type"] == "abort" and spec.stats["num_failed_reqs"] == 1
    assert got["p0"] == want["p0"] and got["p7"] == want["p7"]
    _assert_no_leaks(spec)


@pytest.mark.parametrize("algo", ALGOS)
def test_retraction_and_aborts_leak_nothing(tiny_llama, default_model_path, algo) -> None:
    """A pool too small for the batch retracts requests; three are aborted mid-run (a verify in flight
    finishes, then they leave). Deterministic mode makes greedy tokens independent of when a request was
    retracted and re-prefilled, so the survivors must equal plain decoding exactly."""
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    path = tiny_llama(vocab_size=512)  # a small head: the test is about slots, not the model
    runner = ModelRunner(ServerArgs(model_path=path, tokenizer_path=default_model_path, page_size=16,
                                    max_total_tokens=640, max_running_requests=16,
                                    enable_deterministic_inference=True, chunked_prefill_size=64))
    ids = {f"r{i}": [(100 + 37 * i + j * 7919) % 500 for j in range(12 + i % 5)] for i in range(16)}
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)

    def abort(sched, step: int) -> None:
        if step == 6:
            for rid in ("r3", "r7", "r11"):
                sched.abort_request(rid)

    want, _ = _run(_sched(runner), ids, params)
    spec = _sched(runner, algo)
    got, metas = _run(spec, ids, params, on_step=abort)
    for rid in ids:
        if rid in ("r3", "r7", "r11"):
            assert metas[rid]["finish_reason"]["type"] == "abort"
            assert got[rid] == want[rid][: len(got[rid])]
        else:
            assert got[rid] == want[rid], rid
    info = spec.get_server_info()
    assert info["num_retractions"] > 0 and info["spec_verify_ct"] > 0, info
    _assert_no_leaks(spec)


def test_stop_rules_hold_inside_an_accepted_run(fast_runner, prompts, tokenizer) -> None:
    p0 = {"p0": prompts["p0"]}
    plain = _sched(fast_runner)
    want, _ = _run(plain, p0, SamplingParams(temperature=0.0, max_new_tokens=24))
    text = tokenizer.decode(want["p0"])
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # a string the output reaches mid-way
    specs = {algo: _sched(fast_runner, algo) for algo in ALGOS}
    for params in (SamplingParams(temperature=0.0, max_new_tokens=7),
                   SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]),
                   SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[want["p0"][9]])):
        a, ma = _run(plain, p0, params)
        for algo, spec in specs.items():
            b, mb = _run(spec, p0, params)
            assert a == b and ma["p0"]["finish_reason"] == mb["p0"]["finish_reason"], (algo, params)
            assert len(b["p0"]) <= params.max_new_tokens and mb["p0"]["spec_verify_ct"] > 0
    for spec in specs.values():
        _assert_no_leaks(spec)


def test_trace_shows_drafts_and_what_was_kept(fast_runner, prompts, tmp_path) -> None:
    import json

    from radixserve.debug.inspect import inspect_trace

    path = tmp_path / "trace.jsonl"
    spec = _sched(fast_runner, "draft_model", trace_batches=str(path))
    _, metas = _run(spec, {"p0": prompts["p0"]}, GREEDY)
    spec.tracer.close()
    verify = [json.loads(line)["schedule"] for line in path.read_text().splitlines()]
    verify = [s for s in verify if s["mode"] == "TARGET_VERIFY"]
    assert len(verify) == metas["p0"]["spec_verify_ct"]
    kept = sum(s["spec_accept_lens"][0] for s in verify)
    assert kept + len(verify) == round(metas["p0"]["spec_accept_length"] * len(verify))
    assert all(0 <= s["spec_accept_lens"][0] <= len(s["spec_drafts"][0]) for s in verify)
    summary = inspect_trace(str(path))
    assert summary["spec_accepted"] == kept and summary["spec_drafts"] >= kept


def test_every_request_takes_part_and_gets_what_plain_decoding_gives(fast_runner, prompts, tokenizer) -> None:
    """Penalties, logit_bias and min_new_tokens are computed per verified position over a history holding
    the drafts before it, seeded draws use the step's own stream, logprobs come per row: with point-mass
    drafts (ngram) every request gets exactly its plain tokens; with sampled drafts (draft_model,
    temperature > 0) a seeded request's tokens are reproducible. Alone and in pairs: steps of <= 4 rows, all
    on the low-bit path, with speculation or without."""
    eos = tokenizer.eos_token_id
    params = {
        "p0": SamplingParams(temperature=0.7, max_new_tokens=16, seed=3),
        "p6": SamplingParams(temperature=0.0, max_new_tokens=16, frequency_penalty=0.5, presence_penalty=0.2),
        "p12": SamplingParams(temperature=0.0, max_new_tokens=16, logit_bias={11: 2.0, 28: -3.0}),
        "p2": SamplingParams(temperature=0.0, max_new_tokens=16, repetition_penalty=1.3),
        "p8": SamplingParams(temperature=0.0, max_new_tokens=16, min_new_tokens=12, stop_token_ids=[eos]),
    }
    sub = {rid: prompts[rid] for rid in params}
    plain, spec = _sched(fast_runner), _sched(fast_runner, "ngram")
    for batch in (["p0"], ["p6", "p12"], ["p2", "p8"]):
        part = {rid: sub[rid] for rid in batch}
        want, mw = _run(plain, part, params, logprobs=True)
        got, mg = _run(spec, part, params, logprobs=True)
        assert got == want, batch
        for rid in batch:
            assert all(abs(a - b) < 1e-4 for a, b in zip(mg[rid]["logprobs"], mw[rid]["logprobs"])), rid
        assert any(m.get("spec_verify_ct") for m in mg.values())
    _assert_no_leaks(spec)
    draft = _sched(fast_runner, "draft_model", disable_radix_cache=True)  # the second run prefills like the first
    runs = [_run(draft, {"p0": prompts["p0"]}, {"p0": params["p0"]}) for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1]["p0"]["spec_verify_ct"] > 0
    _assert_no_leaks(draft)


def test_server_args_bounds(tiny_llama, fast_runner) -> None:
    from radixserve.server_args import ServerArgs

    ServerArgs(speculative_algorithm="ngram", page_size=16)
    assert ServerArgs(speculative_algorithm="None").speculative_algorithm is None  # the CLI's spelling
    for kw, field in (({"speculative_algorithm": "eagle9"}, "speculative_algorithm"),
                      ({"speculative_algorithm": "draft_model"}, "speculative_draft_model_path"),
                      ({"speculative_draft_model_path": "/x"}, "speculative_draft_model_path"),
                      ({"speculative_algorithm": "draft_model", "speculative_draft_model_path": "/x", "tp_size": 2},
                       "speculative_algorithm"),
                      ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                      ({"speculative_num_draft_tokens": 17}, "speculative_num_draft_tokens"),
                      ({"speculative_num_draft_tokens": 10**9}, "speculative_num_draft_tokens"),
                      ({"speculative_ngram_max_match_window": 10**6}, "speculative_ngram_min_match_window"),
                      ({"speculative_ngram_min_match_window": 0}, "speculative_ngram_min_match_window")):
        with pytest.raises(ValueError, match=field):
            ServerArgs(**kw)
    # at start-up: a draft of another vocabulary, a draft that is not there
    with pytest.raises(ValueError, match=r"speculative_draft_model_path: the draft model's vocabulary has 320"):
        _sched(fast_runner, "draft_model", draft=tiny_llama(vocab_size=320))
    with pytest.raises(ValueError, match="speculative_draft_model_path: '/nonexistent/draft' does not exist"):
        _sched(fast_runner, "draft_model", draft="/nonexistent/draft")
