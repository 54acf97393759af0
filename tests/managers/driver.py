"""Drive an in-process Scheduler step by step (the ZMQ loop's job, done explicitly in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class Finished:
    output_ids: list[int] = field(default_factory=list)
    top2: list[list[tuple[int, float]]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    reason: dict | None = None


def greedy(max_new_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def run(sched, prompts: dict[str, list[int]], params: SamplingParams | dict[str, SamplingParams],
        arrive: dict[str, int] | None = None, on_step=None, max_steps: int = 100_000,
        logprobs: bool = True) -> dict[str, Finished]:
    """Submit prompts (at step arrive[rid], default 0) and step until all finish. `params`: one for
    every request, or one per rid."""
    arrive = arrive or {}
    results = {rid: Finished() for rid in prompts}
    pending = dict(prompts)
    step = 0
    while pending or sched.has_work():
        for rid in [r for r in pending if arrive.get(r, 0) <= step]:
            p = params[rid] if isinstance(params, dict) else params
            err = sched.add_request(TokenizedGenerateReqInput(
                rid, pending.pop(rid), p, return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0))
            assert err is None, err.error
        for out in sched.step():
            res = results[out.rid]
            res.output_ids.extend(out.new_token_ids)
            res.top2.extend(out.output_top_logprobs)
            if out.finished_reason is not None:
                res.reason, res.meta = out.finished_reason, out.meta_info
        if on_step is not None:
            on_step(step)
        step += 1
        assert step < max_steps
    return results


def compare(alone: dict[str, Finished], other: dict[str, Finished], tie: float = 1e-3) -> int:
    """Assert identical tokens; a divergence is excused only where the lone run's top-two
    logprobs differ by less than `tie`. Returns how many divergences were excused."""
    excused = 0
    for rid, ref in alone.items():
        got = other[rid].output_ids
        assert len(got) == len(ref.output_ids), f"{rid}: {len(got)} vs {len(ref.output_ids)} tokens"
        for j, (a, b) in enumerate(zip(ref.output_ids, got)):
            if a != b:
                (_, l1), (_, l2) = ref.top2[j][:2]
                assert l1 - l2 < tie, f"{rid}: token {j} differs ({a} vs {b}) with top-2 gap {l1 - l2:.2e}"
                excused += 1
                break
    return excused
