"""One request's failure fails that request alone: a forward that raises is bisected until the
failure is pinned (Scheduler._run_isolated), the other requests finish with the tokens they would
have had, a timed-out request is aborted with its KV returned, and nothing leaks."""

from __future__ import annotations

import random

import pytest

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from tests.managers.driver import Finished, compare, greedy, run
from tests.managers.test_prefix_and_abort import assert_no_leak


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    rng = random.Random(5)
    words = "alpha beta gamma delta river stone cloud paper engine lantern harbor violin".split()
    out = {}
    for i in range(7):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        out[f"r{i}"] = tokenizer.encode(text, add_special_tokens=False)
    return out


def _run_with_faults(sched, prompts, params, arrive=None, on_step=None):
    """Like driver.run, but keeps each request's error instead of asserting there is none."""
    arrive = arrive or {}
    results = {rid: Finished() for rid in prompts}
    errors: dict[str, tuple[int, str]] = {}
    pending, step = dict(prompts), 0
    while pending or sched.has_work():
        for rid in [r for r in pending if arrive.get(r, 0) <= step]:
            assert sched.add_request(TokenizedGenerateReqInput(
                rid, pending.pop(rid), params, return_logprob=True, top_logprobs_num=2)) is None
        for out in sched.step():
            res = results[out.rid]
            res.output_ids.extend(out.new_token_ids)
            res.top2.extend(out.output_top_logprobs)
            if out.error is not None:
                errors[out.rid] = (out.error_status, out.error)
            if out.finished_reason is not None:
                res.reason, res.meta = out.finished_reason, out.meta_info
        if on_step is not None:
            on_step(step)
        step += 1
        assert step < 10_000
    return results, errors


@pytest.mark.parametrize(("page_size", "mixed", "fault_at_step"), [(1, False, 0), (16, False, 3), (1, True, 4)])
def test_failing_request_fails_alone(make_scheduler, prompts, page_size, mixed, fault_at_step) -> None:
    params = greedy(10)
    ref = run(make_scheduler(page_size=page_size), {k: v for k, v in prompts.items() if k != "r3"}, params)
    sched = make_scheduler(page_size=page_size, enable_mixed_chunk=mixed, chunked_prefill_size=32)
    # the faulty request is r3; with fault_at_step > 0 it fails mid-decode (or inside a MIXED step,
    # where late arrivals' chunks and the running decodes share one forward)
    arrive = {"r5": 2, "r6": 3} if mixed else {}

    def arm(step: int) -> None:
        if step + 1 == fault_at_step:
            sched.fault_marker = "r3"

    if fault_at_step == 0:
        sched.fault_marker = "r3"
    got, errors = _run_with_faults(sched, prompts, params, arrive, arm)
    assert set(errors) == {"r3"}, errors
    status, message = errors["r3"]
    assert status == 500 and "injected fault" in message, errors
    assert got["r3"].reason["type"] == "abort"
    del got["r3"]
    compare(ref, got)
    assert sched.stats["num_failed_reqs"] == 1
    sched.fault_marker = None
    assert_no_leak(sched)


def test_every_request_of_a_batch_failing(make_scheduler, prompts) -> None:
    sched = make_scheduler()
    sched.fault_marker = "r"  # every rid: each is pinned and failed, the scheduler keeps going
    _, errors = _run_with_faults(sched, prompts, greedy(4))
    assert set(errors) == set(prompts) and all(s == 500 for s, _ in errors.values())
    assert sched.failed_forward_streak > 0
    sched.fault_marker = None
    res = run(sched, {"after": prompts["r0"]}, greedy(4))  # and it still serves
    assert len(res["after"].output_ids) == 4
    assert sched.failed_forward_streak == 0
    assert_no_leak(sched)


def test_timeout_aborts_waiting_and_running(make_scheduler, prompts) -> None:
    sched = make_scheduler(max_running_requests=1)
    for rid in ("run", "wait"):  # "wait" sits in the queue behind "run" (one running slot)
        req = TokenizedGenerateReqInput(rid, prompts["r1"], greedy(200), timeout=0.5)
        assert sched.add_request(req) is None
    errors = {}
    while sched.has_work():
        for out in sched.step():
            if out.error is not None:
                errors[out.rid] = (out.error_status, out.error)
    assert set(errors) == {"run", "wait"}
    assert all(s == 408 and "timeout" in m for s, m in errors.values()), errors
    assert sched.stats["num_timed_out_reqs"] == 2
    assert_no_leak(sched)
