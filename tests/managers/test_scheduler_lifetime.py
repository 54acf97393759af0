"""A Scheduler's helpers own their state: none holds the scheduler, so a dropped Scheduler (and its
ModelRunner, KV pool included) is freed at once by reference counting, not at some later garbage
collection. Before, FailureIsolation and InvariantChecker kept `self.s = scheduler`: every scheduler lived
in a cycle, and a test session that made many of them held a KV pool per scheduler until the collector ran
(the suite was killed for memory)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.managers.driver import greedy, run


@pytest.mark.parametrize("kw", [
    dict(check_invariants=True),
    dict(check_invariants=True, speculative_algorithm="ngram", speculative_num_draft_tokens=3),
    dict(check_invariants=True, is_embedding=True),
], ids=["plain", "ngram", "embedding"])
def test_a_dropped_scheduler_is_freed_without_the_collector(make_scheduler, tokenizer, kw) -> None:
    prompt = tokenizer.encode("the cat sat on the mat, the cat sat on the", add_special_tokens=False)
    gc.collect()
    gc.disable()
    try:
        sched = make_scheduler(max_total_tokens=2048, **kw)
        out = run(sched, {"a": prompt, "b": prompt[:5]}, greedy(0 if kw.get("is_embedding") else 6),
                  logprobs=not kw.get("is_embedding"))
        assert out["a"].reason is not None and out["b"].reason is not None
        sched_ref, runner_ref = weakref.ref(sched), weakref.ref(sched.model_runner)
        pool_ref = weakref.ref(sched.model_runner.token_to_kv_pool)
        del sched
        assert sched_ref() is None, [type(r).__name__ for r in gc.get_referrers(sched_ref())]
        assert runner_ref() is None and pool_ref() is None
    finally:
        gc.enable()
