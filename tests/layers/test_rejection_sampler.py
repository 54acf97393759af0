"""RejectionSampler keeps the target distribution, checked with chi-square tests on real logits of two tiny
random Llamas over a 16-token vocabulary (target and draft), after the request's own processing
(temperature, top-k, top-p):

- drafts sampled from the draft's q: the first token produced follows the target's processed softmax
  and plain sampling, a draft is kept with probability sum_x min(p(x), q(x)), and the token after a
  kept draft x follows the target's distribution given x;
- point-mass drafts (n-gram lookup): the same, kept with probability p(x); seeded rows reproduce;
- a deliberately broken rule (the residual drawn from p instead of max(0, p - q)) fails the same test.

Fixed seeds throughout: the test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import rejection_sampler
from radixserve.layers.rejection_sampler import RejectionSampler
from radixserve.layers.sampler import Sampler
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams
from tests.model_executor.hand_batch import HandBatch
from tests.speculative.chi_square import chi_square, counts, goodness_of_fit, p_value, same_distribution

V = 16
PARAMS = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
PROMPT = [3, 7, 1, 12, 5]
N = 6000
PASS = 1e-3  # p-values: a correct rule passes above this, a broken one lands far below


def _info(n: int, params: SamplingParams = PARAMS) -> SamplingBatchInfo:
    return SamplingBatchInfo.build([params] * n, None, V, None, "cpu")


@pytest.fixture(scope="module")
def logits(tiny_llama, default_model_path) -> tuple[torch.Tensor, torch.Tensor]:
    """(target's next-token logits after PROMPT and after PROMPT + [x] for every x: [1 + V, V],
    draft's after PROMPT: [1, V])."""
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    def last_logits(path: str, seqs: list[list[int]]) -> torch.Tensor:
        runner = ModelRunner(ServerArgs(model_path=path, tokenizer_path=default_model_path, max_total_tokens=512,
                                        max_running_requests=24))
        hb = HandBatch(runner)
        res = hb.run([(hb.new_req(), s) for s in seqs], full=False)
        hb.release_all()
        return res.logits_output.next_token_logits.float()

    # a wide init makes peaked distributions, so that target and draft differ clearly
    target = last_logits(tiny_llama(V, seed=0, init_std=0.1), [PROMPT] + [PROMPT + [x] for x in range(V)])
    draft = last_logits(tiny_llama(V, seed=1, init_std=0.1), [PROMPT])
    return target, draft


def _verify(target: torch.Tensor, draft_q: torch.Tensor | None, x: torch.Tensor, seed: int):
    """N independent verify steps of one draft each: rows [p_0, p_1(. | x_n)] per trial."""
    rows = torch.stack([target[0].expand(N, V), target[1 + x]], dim=1).reshape(2 * N, V)
    input_ids = torch.stack([torch.full((N,), PROMPT[-1]), x], dim=1).reshape(-1).tolist()
    torch.manual_seed(seed)
    ids, accept = RejectionSampler(Sampler())(rows, _info(2 * N), input_ids, [1] * N,
                                              [None if draft_q is None else draft_q[None]] * N)
    return ids.view(N, 2), torch.tensor(accept)


@pytest.mark.parametrize("rule", ["standard", "broken_residual"])
def test_sampled_drafts_keep_the_target_distribution(logits, rule, monkeypatch) -> None:
    if rule == "broken_residual":
        monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q: p.clone())
    target, draft = logits
    sampler = Sampler()
    p0 = sampler.probs(target[:1], _info(1))[0]
    q0 = sampler.probs(draft, _info(1))[0]
    assert 0.2 < 1 - torch.minimum(p0, q0).sum() < 0.8, "target and draft should differ clearly"
    x = torch.multinomial(q0, N, replacement=True, generator=torch.Generator().manual_seed(0))  # drafts ~ q
    ids, accept = _verify(target, q0, x, seed=1)
    torch.manual_seed(2)
    plain = sampler(target[:1].expand(N, V), _info(N))
    first_vs_p = goodness_of_fit(counts(ids[:, 0], V), p0)
    first_vs_plain = same_distribution(counts(ids[:, 0], V), counts(plain, V))
    if rule == "broken_residual":
        assert first_vs_p < 1e-6 and first_vs_plain < 1e-6, (first_vs_p, first_vs_plain)
        return
    assert first_vs_p > PASS and first_vs_plain > PASS, (first_vs_p, first_vs_plain)
    # P(keep) = sum_x min(p(x), q(x)); a kept draft is the first token
    rate, want = accept.double().mean().item(), torch.minimum(p0, q0).sum().item()
    assert abs(rate - want) < 4 * (want * (1 - want) / N) ** 0.5, (rate, want)
    assert torch.equal(ids[accept == 1, 0], x[accept == 1])
    # the bonus token after a kept draft x ~ the target's distribution given x (pooled over x)
    stat, df = 0.0, 0
    for tok in range(V):
        sel = (accept == 1) & (x == tok)
        if sel.sum() >= 50:
            s, d = chi_square(counts(ids[sel, 1], V), sampler.probs(target[1 + tok : 2 + tok], _info(1))[0])
            stat, df = stat + s, df + d
    assert df > 0 and p_value(stat, df) > PASS, (stat, df)


def test_point_mass_drafts_keep_the_target_distribution(logits) -> None:
    """n-gram drafts: a deterministic proposal x is kept iff the target's own draw equals it (P = p(x)),
    and the first token is the target's draw either way."""
    target, _ = logits
    sampler = Sampler()
    p0 = sampler.probs(target[:1], _info(1))[0]
    tok = int(p0.argsort()[-2])  # the second most likely token: kept about p0[tok] of the time
    ids, accept = _verify(target, None, torch.full((N,), tok), seed=3)
    assert goodness_of_fit(counts(ids[:, 0], V), p0) > PASS
    rate, want = accept.double().mean().item(), p0[tok].item()
    assert abs(rate - want) < 4 * (want * (1 - want) / N) ** 0.5, (rate, want)
    assert goodness_of_fit(counts(ids[accept == 1, 1], V), sampler.probs(target[1 + tok : 2 + tok], _info(1))[0]) > PASS


def test_seeded_rows_reproduce(logits) -> None:
    target, draft = logits
    sampler = Sampler()
    q0 = sampler.probs(draft, _info(1))[0]
    p0 = sampler.probs(target[:1], _info(1))[0]
    tok = int((q0 - p0).argmax())  # a draft the rule keeps with probability p / q < 1
    rows = torch.stack([target[0], target[1 + tok]]).repeat(64, 1)  # 64 trials of that draft
    input_ids = [PROMPT[-1], tok] * 64
    params = [SamplingParams(temperature=0.8, top_k=12, seed=i // 2) for i in range(128)]
    info = SamplingBatchInfo.build(params, None, V, None, "cpu")
    runs = [RejectionSampler(sampler)(rows, info, input_ids, [1] * 64, [q0[None]] * 64) for _ in range(2)]
    torch.manual_seed(99)  # the global RNG plays no part for seeded rows
    runs.append(RejectionSampler(sampler)(rows, info, input_ids, [1] * 64, [q0[None]] * 64))
    assert all(torch.equal(r[0], runs[0][0]) and r[1] == runs[0][1] for r in runs)
    assert 0 < sum(runs[0][1]) < 64  # some kept, some rejected
