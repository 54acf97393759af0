"""Drive an in-process Scheduler with per-request adapters, and the transformers + peft reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class Out:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    error: tuple[int, str] | None = None


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def run(sched, reqs: dict[str, tuple[list[int], str | None]], n: int = 8,
        arrive: dict[str, int] | None = None) -> dict[str, Out]:
    """reqs: rid -> (prompt ids, adapter name or None); submitted at step arrive[rid] (default 0)."""
    arrive = arrive or {}
    outs = {rid: Out() for rid in reqs}
    pending = dict(reqs)
    step = 0
    while pending or sched.has_work():
        for rid in [r for r in pending if arrive.get(r, 0) <= step]:
            ids, lora = pending.pop(rid)
            err = sched.add_request(TokenizedGenerateReqInput(rid, ids, greedy(n), return_logprob=True,
                                                              lora_path=lora))
            if err is not None:
                outs[rid].error = (err.error_status, err.error)
        for o in sched.step():
            res = outs[o.rid]
            res.ids.extend(o.new_token_ids)
            res.logprobs.extend(o.output_token_logprobs)
            if o.finished_reason is not None:
                res.meta = o.meta_info
        step += 1
        assert step < 10_000
    return outs


@torch.no_grad()
def reference(model, prompt: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a transformers (+ peft) model, recomputed in full each step."""
    ids = list(prompt)
    lps = []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        t = int(lp.argmax())
        ids.append(t)
        lps.append(float(lp[t]))
    return ids[len(prompt):], lps


def assert_matches(got: Out, ref: tuple[list[int], list[float]], tol: float = 1e-4, what: str = "") -> None:
    assert got.error is None, got.error
    assert got.ids == ref[0], f"{what}: {got.ids} != {ref[0]}"
    diff = max(abs(a - b) for a, b in zip(got.logprobs, ref[1]))
    assert diff <= tol, f"{what}: logprob diff {diff:.2e}"
