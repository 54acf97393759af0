"""Prefix reuse through the radix cache, LRU eviction, aborts at every stage, and no leaks."""

from __future__ import annotations

import random

import pytest

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from tests.managers.driver import compare, greedy, run


@pytest.fixture(scope="module")
def long_text_ids(tokenizer) -> list[int]:
    rng = random.Random(3)
    words = "alpha beta gamma delta river stone cloud paper engine lantern harbor violin".split()
    text = " ".join(rng.choice(words) for _ in range(900))
    return tokenizer.encode(text, add_special_tokens=False)


def assert_no_leak(sched) -> None:
    alloc, tree, pool = sched.allocator, sched.tree_cache, sched.req_to_token_pool
    assert alloc.available_size() + tree.total_size() == alloc.total_size
    assert pool.available_size() == pool.size
    assert not sched.has_work()
    assert sched.flush_cache()
    assert alloc.available_size() == alloc.total_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_500_token_prefix_is_reused(make_scheduler, long_text_ids, page_size):
    prefix = long_text_ids[:500]
    first, second = prefix + long_text_ids[600:620], prefix + long_text_ids[700:730]
    sched = make_scheduler(page_size=page_size)
    run(sched, {"a": first}, greedy())
    res = run(sched, {"b": second}, greedy())
    assert res["b"].meta["cached_tokens"] >= 496
    assert res["b"].meta["cached_tokens"] % page_size == 0
    nocache = run(make_scheduler(disable_radix_cache=True, page_size=page_size), {"b": second}, greedy())
    assert nocache["b"].meta["cached_tokens"] == 0
    compare(nocache, res)
    assert_no_leak(sched)


def test_lru_eviction_under_pressure_keeps_answers(make_scheduler, long_text_ids):
    prompts = {f"p{i}": long_text_ids[i * 90 : i * 90 + 120] for i in range(8)}
    roomy = make_scheduler()
    ref = {}
    for rid, ids in prompts.items():
        ref.update(run(roomy, {rid: ids}, greedy()))
    # room for ~2 finished prompts in the tree: later requests must evict earlier ones (LRU)
    tight = make_scheduler(max_total_tokens=360)
    got = {}
    for rid, ids in list(prompts.items()) + list(prompts.items())[:3]:
        got.update(run(tight, {rid: ids}, greedy()))
        assert tight.tree_cache.total_size() <= 360
    compare(ref, got)
    assert got["p0"].meta["cached_tokens"] == 0  # least recently used: evicted before its rerun
    again = run(tight, {"p2": prompts["p2"]}, greedy())  # just used: still cached
    assert again["p2"].meta["cached_tokens"] >= 100
    compare({"p2": ref["p2"]}, again)
    assert_no_leak(tight)


def _submit(sched, rid, ids, max_new=16):
    assert sched.add_request(TokenizedGenerateReqInput(rid, ids, greedy(max_new))) is None


def _drain(sched):
    outs = {}
    while sched.has_work():
        for o in sched.step():
            if o.finished_reason:
                outs[o.rid] = o
    return outs


def test_abort_while_waiting(make_scheduler, long_text_ids):
    sched = make_scheduler(max_running_requests=1)
    _submit(sched, "run", long_text_ids[:50])
    _submit(sched, "wait", long_text_ids[50:100])
    sched.step()
    assert [r.rid for r in sched.waiting_queue] == ["wait"]
    sched.abort_request("wait")
    outs = {o.rid: o for o in sched.step()}
    outs.update(_drain(sched))
    assert outs["wait"].finished_reason["type"] == "abort"
    assert outs["run"].finished_reason["type"] == "length"
    assert_no_leak(sched)


def test_abort_mid_chunked_prefill(make_scheduler, long_text_ids):
    for page_size in (1, 16):
        sched = make_scheduler(chunked_prefill_size=64, page_size=page_size)
        _submit(sched, "long", long_text_ids[:400])
        sched.step()
        sched.step()
        assert sched.chunked_req is not None and sched.chunked_req.rid == "long"
        sched.abort_request("long")
        outs = _drain(sched)
        assert outs["long"].finished_reason["type"] == "abort"
        assert outs["long"].new_token_ids == []
        assert_no_leak(sched)


def test_abort_mid_decode_others_continue(make_scheduler, long_text_ids):
    sched = make_scheduler()
    _submit(sched, "a", long_text_ids[:30])
    _submit(sched, "b", long_text_ids[30:70])
    for _ in range(4):
        sched.step()
    assert len(sched.running_batch.reqs) == 2
    sched.abort_request("a")
    outs = _drain(sched)
    assert outs["a"].finished_reason["type"] == "abort"
    assert outs["b"].finished_reason["type"] == "length"
    assert outs["b"].meta_info["completion_tokens"] == 16
    assert_no_leak(sched)


def test_flush_refused_while_busy(make_scheduler, long_text_ids):
    sched = make_scheduler()
    _submit(sched, "a", long_text_ids[:30])
    sched.step()
    assert sched.flush_cache() is False
    _drain(sched)
    assert_no_leak(sched)


def test_bad_requests_rejected_others_finish(make_scheduler, long_text_ids):
    from radixserve.sampling.sampling_params import SamplingParams

    sched = make_scheduler(context_length=256)
    _submit(sched, "good", long_text_ids[:20], max_new=8)
    cases = {
        "oov": (long_text_ids[:5] + [10**6], greedy(), "input_ids"),
        "empty": ([], greedy(), "prompt"),
        "too_long": (long_text_ids[:256], greedy(), "prompt"),
        "neg_max": (long_text_ids[:5], SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        # an explicit max_new_tokens the context cannot hold is refused (as OpenAI does), not clipped
        "over_ctx": (long_text_ids[:255], greedy(8), "max_new_tokens"),
        "huge_max": (long_text_ids[:5], SamplingParams(max_new_tokens=10**300), "max_new_tokens"),
    }
    for rid, (ids, params, field) in cases.items():
        err = sched.add_request(TokenizedGenerateReqInput(rid, ids, params))
        assert err is not None and err.error.startswith(field), err
    # exactly filling the context with the one generated token is fine
    assert sched.add_request(TokenizedGenerateReqInput("fits", long_text_ids[:255], greedy(1))) is None
    outs = _drain(sched)
    assert outs["good"].meta_info["completion_tokens"] == 8
    assert outs["fits"].meta_info["completion_tokens"] == 1
    assert_no_leak(sched)
