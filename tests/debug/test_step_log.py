"""StepLog: the scheduler's ring of step records (the web dashboard's pipeline) is the record
--trace-batches writes, stays bounded, says why requests wait, and costs microseconds per step."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from radixserve.debug.step_log import StepLog
from radixserve.debug.trace import StepRecord
from tests.managers.driver import greedy, run


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    shared = tokenizer.encode("You are the keeper of a lighthouse on a rock in the sea. " * 3)
    return {"a": shared + tokenizer.encode("What do you see?"), "b": shared + tokenizer.encode("Who visits?"),
            "c": tokenizer.encode("Count to ten:")}


def test_ring_holds_what_the_trace_file_writes(make_scheduler, prompts, tmp_path) -> None:
    trace = tmp_path / "steps.jsonl"
    sched = make_scheduler(trace_batches=str(trace))
    res = run(sched, prompts, greedy(6), arrive={"b": 3})
    sched.tracer.close()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    records = [r.to_json() for r in sched.step_log.ring]
    assert len(records) == len(lines) == sched.forward_ct > 0
    for rec, line in zip(records, lines):
        assert line["schedule"] == rec["schedule"] and line["timing"] == rec["timing"]
        assert {k: line["forward"][k] for k in rec["forward"]} == rec["forward"]  # + the tensors in the file
        s, f = rec["schedule"], rec["forward"]
        assert f["forward_mode"] == s["mode"] and f["batch_size"] == len(s["rids"])
        assert sum(s["extend_lens"]) == f["num_tokens"] == len(line["forward"]["input_ids"])
        positions = line["forward"]["positions"]
        assert f["positions_range"] == [min(positions), max(positions)]
        assert f["num_prefill_tokens"] == (0 if s["mode"] == "DECODE" else f["num_tokens"])
        assert all(v >= 0 for v in rec["timing"].values()) and rec["timing"]["forward_ms"] > 0
    # b arrived later and shares a's prefix: its admission step shows the cached part as prefix
    first_b = next(r["schedule"] for r in records if "b" in r["schedule"]["rids"])
    i = first_b["rids"].index("b")
    assert first_b["prefix_lens"][i] == res["b"].meta["cached_tokens"] > 0
    prompt_tokens = sum(len(p) for p in prompts.values())
    cached = sum(r.meta["cached_tokens"] for r in res.values())
    assert sched.step_log.num_prefill_tokens == prompt_tokens - cached


def test_snapshot_since_rid_and_limit(make_scheduler, prompts) -> None:
    sched = make_scheduler()
    sched.step_log = StepLog(capacity=5)
    run(sched, prompts, greedy(6))
    ring = list(sched.step_log.ring)
    assert len(ring) == 5 and sched.forward_ct > 5  # bounded: the oldest records fell out
    last = ring[-1].step
    snap = sched.get_steps(since=-1)
    assert [r["step"] for r in snap["steps"]] == [r.step for r in ring]
    assert snap["last_step"] == last and snap["oldest_step"] == ring[0].step
    assert [r["step"] for r in sched.get_steps(since=last - 3)["steps"]] == [last - 2, last - 1, last]
    assert [r["step"] for r in sched.get_steps(since=-1, limit=2)["steps"]] == [last - 1, last]
    assert sched.get_steps(since=last)["steps"] == []
    some = ring[-1].rids[0]
    mine = sched.get_steps(since=-1, rid=some)["steps"]
    assert mine and all(some in r["schedule"]["rids"] for r in mine)
    assert sched.get_steps(since=-1, rid="nobody")["steps"] == []
    assert snap["num_evictable_tokens"] == sched.tree_cache.evictable_size()


def _reasons(sched) -> set[str]:
    return {r.wait_reason for r in sched.step_log.ring if r.num_waiting}


def test_wait_reason_max_running_requests(make_scheduler, prompts) -> None:
    sched = make_scheduler(max_running_requests=1)
    run(sched, prompts, greedy(2))
    assert _reasons(sched) == {"max_running_requests"}


def test_wait_reason_chunked_prefill(make_scheduler, tokenizer) -> None:
    long = tokenizer.encode("the river runs to the sea " * 22)  # ~130 tokens: 3 chunks of 64
    sched = make_scheduler(chunked_prefill_size=64)
    run(sched, {"long": long, "short": tokenizer.encode("Hi there")}, greedy(2))
    assert "chunked_prefill" in _reasons(sched)
    chunks = [r for r in sched.step_log.ring if r.chunked_rid == "long"]
    assert chunks and all(r.num_tokens <= 64 for r in chunks)


def test_wait_reason_prefill_budget(make_scheduler, prompts) -> None:
    sched = make_scheduler(max_prefill_tokens=40)
    run(sched, prompts, greedy(2))
    assert "max_prefill_tokens" in _reasons(sched)


def test_record_costs_microseconds(make_scheduler, prompts, monkeypatch) -> None:
    """The per-step cost the ring adds (the dashboard may not slow decode): a real decode step's
    capture, repeated. ~5 us on the reference machine; the bound only catches a regression such as
    reading tensors (.tolist()) every step."""
    sched = make_scheduler()
    real = sched.step_log.record
    per_call: list[float] = []

    def spy(step, batch, result, queue, *rest):
        if batch.forward_mode.name == "DECODE" and batch.batch_size() == 9 and not per_call:
            for _ in range(5):  # time the capture of this real step while its batch is live
                t0 = time.perf_counter()
                for _ in range(400):
                    StepRecord.capture(step, batch, result, queue, (0.0, 0.0, 0.0, 0.0))
                per_call.append((time.perf_counter() - t0) / 400)
        return real(step, batch, result, queue, *rest)

    monkeypatch.setattr(sched.step_log, "record", spy)
    run(sched, {f"r{i}": ids for i, ids in enumerate(list(prompts.values()) * 3)}, greedy(3))
    assert per_call, "no decode step of 9 requests ran"
    assert statistics.median(per_call) < 50e-6, f"{statistics.median(per_call) * 1e6:.1f} us per step"
