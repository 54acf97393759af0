"""Sampling with speculation follows the target distribution end to end: the real Scheduler on a tiny random
Llama with a 16-token vocabulary (another one, of different weights, as its draft), temperature 0.9 and
top-p 0.95, N requests of one prompt.

- draft_model (drafts sampled from the draft's q): the 2nd, 3rd and 4th tokens, which verify steps
  produce (kept drafts, residual draws, bonus tokens), pass chi-square tests against plain sampling, the
  2nd also against the target's exact marginal (enumerated over the 1st); seeded runs reproduce.
- ngram (point-mass drafts from the request's own tokens): every seeded request gets exactly the tokens
  plain sampling gives it.

Every request has its own seed, so the test is deterministic."""

from __future__ import annotations

import pytest
import torch

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from tests.model_executor.hand_batch import HandBatch
from tests.speculative.chi_square import counts, goodness_of_fit, same_distribution

V = 16
PROMPT = [3, 7, 1, 12, 5, 3, 7, 1, 12, 5, 3, 7]  # it repeats itself: prompt lookup finds drafts
N = 800
PASS = 1e-3


def _params(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=4, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def plain(tiny_llama, default_model_path):
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    # the same two models test_rejection_sampler.py checks the rule on directly
    args = ServerArgs(model_path=tiny_llama(V, seed=0, init_std=0.1), tokenizer_path=default_model_path,
                      max_total_tokens=2048, max_running_requests=64, check_invariants=True,
                      speculative_ngram_min_match_window=1)
    return Scheduler(args)


def _spec(plain, algo: str, draft: str | None = None):
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    args = plain.server_args.replace(speculative_algorithm=algo, speculative_draft_model_path=draft)
    return Scheduler(args, model_runner=ModelRunner(args, model=plain.model_runner.model))


def _generate(sched, seeds: range) -> torch.Tensor:
    """[len(seeds), 4] generated tokens, one request per seed."""
    outs: dict[str, list[int]] = {}
    for s in seeds:
        assert sched.add_request(TokenizedGenerateReqInput(f"s{s}", PROMPT, _params(s))) is None
        outs[f"s{s}"] = []
    while sched.has_work():
        for o in sched.step():
            outs[o.rid].extend(o.new_token_ids)
    info = sched.get_server_info()
    assert info["num_used_tokens"] == 0 and info.get("spec_draft_num_used_tokens", 0) == 0, info
    return torch.tensor([outs[f"s{s}"] for s in seeds])


@pytest.fixture(scope="module")
def plain_tokens(plain) -> torch.Tensor:
    return _generate(plain, range(N))


def test_draft_model_sampling_follows_the_target(plain, plain_tokens, tiny_llama) -> None:
    spec = _spec(plain, "draft_model", tiny_llama(V, seed=1, init_std=0.1))
    got = _generate(spec, range(N))
    info = spec.get_server_info()
    assert info["spec_verify_ct"] > N / 2 and 1.2 < info["spec_accept_length"] < 3.5, info  # kept and rejected
    for pos in (1, 2, 3):
        p = same_distribution(counts(got[:, pos], V), counts(plain_tokens[:, pos], V))
        assert p > PASS, (pos, p)
    # the 2nd token's exact marginal: sum over the 1st token x of p(x) * p(. | x)
    hb = HandBatch(plain.model_runner)
    res = hb.run([(hb.new_req(), s) for s in [PROMPT] + [PROMPT + [x] for x in range(V)]], full=False)
    hb.release_all()
    from radixserve.layers.sampler import Sampler
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

    info_rows = SamplingBatchInfo.build([_params(None)] * (1 + V), None, V, None, "cpu")
    probs = Sampler().probs(res.logits_output.next_token_logits.float(), info_rows)  # [1 + V, V]
    marginal = probs[0] @ probs[1:]
    assert goodness_of_fit(counts(got[:, 1], V), marginal) > PASS
    assert goodness_of_fit(counts(plain_tokens[:, 1], V), marginal) > PASS  # the reference itself
    assert torch.equal(_generate(spec, range(64)), got[:64])  # seeded: reproducible


def test_ngram_sampling_gives_the_plain_tokens(plain, plain_tokens) -> None:
    spec = _spec(plain, "ngram")
    got = _generate(spec, range(N // 4))
    assert spec.get_server_info()["spec_verify_ct"] > 0
    assert torch.equal(got, plain_tokens[: N // 4])
