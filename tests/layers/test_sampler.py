"""Sampler: greedy == argmax, filter sets, sampling distribution, per-request seeds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from radixserve.layers.sampler import Sampler, draw_uniforms, filter_probs_, sample_from_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams

EOS = [0]
sampler = Sampler()


def sample(
    params: list[SamplingParams],
    logits: torch.Tensor,
    output_ids: list[list[int]] | None = None,
) -> torch.Tensor:
    info = SamplingBatchInfo.build(params, output_ids, logits.shape[1], EOS, "cpu")
    return sampler(logits.clone(), info)


def kept_reference(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The filters by hand: top_k, then top_p on the renormalised survivors, then min_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k]
    mass = sum(probs[i] for i in kept)
    cum, nucleus = 0.0, []
    for i in kept:
        nucleus.append(i)
        cum += probs[i] / mass
        if cum >= top_p:
            break
    top = probs[order[0]]
    return {i for i in nucleus if probs[i] >= min_p * top}


# ---------------------------------------------------------------------- greedy
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(2, 300), st.integers(0, 2**31), st.booleans())
def test_temperature_zero_is_argmax(bs: int, vocab: int, seed: int, mixed: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, vocab, generator=gen) * 3
    greedy = torch.rand(bs, generator=gen) < 0.5 if mixed else torch.ones(bs, dtype=torch.bool)
    params = [
        SamplingParams(temperature=0.0) if g else SamplingParams(temperature=0.8, top_k=5)
        for g in greedy.tolist()
    ]
    got = sample(params, logits)
    assert got.dtype == torch.int64 and got.shape == (bs,)
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(got[greedy], want[greedy])


def test_top_k_one_is_greedy_and_greedy_sees_processed_logits() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2)
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.0, logit_bias={2: 2.0})]
    assert sample(params, logits).tolist() == [1, 2]


def test_greedy_batch_takes_fast_path() -> None:
    # No noise is drawn: the global RNG state is untouched.
    logits = torch.randn(3, 50)
    state = torch.get_rng_state()
    sample([SamplingParams(temperature=0.0)] * 3, logits)
    assert torch.equal(state, torch.get_rng_state())


# ---------------------------------------------------------------------- filters
@st.composite
def distributions(draw: st.DrawFn):
    vocab = draw(st.integers(1, 30))
    weights = draw(st.lists(st.integers(1, 1000), min_size=vocab, max_size=vocab, unique=True))
    total = sum(weights)
    return [w / total for w in weights]


@settings(max_examples=60, deadline=None)
@given(
    distributions(),
    st.integers(1, 40),
    st.floats(0.01, 1.0),
    st.floats(0.0, 1.0),
    st.sampled_from(["k", "p", "min_p", "all"]),
    st.sampled_from([None, 1, 2, 5]),
)
def test_filter_keeps_exactly_the_reference_set(
    probs: list[float], top_k: int, top_p: float, min_p: float, which: str, candidates: int | None
) -> None:
    vocab = len(probs)
    top_k = min(top_k, vocab) if which in ("k", "all") else vocab
    top_p = top_p if which in ("p", "all") else 1.0
    min_p = min_p if which in ("min_p", "all") else 0.0
    # Stay clear of float ties at a threshold: the rule, not the rounding, is under test.
    kept_k = sorted(probs, reverse=True)[:top_k]
    partial = [sum(kept_k[: j + 1]) / sum(kept_k) for j in range(len(kept_k))]
    assume(all(abs(c - top_p) > 1e-5 for c in partial[:-1]))
    assume(all(abs(p - min_p * max(probs)) > 1e-6 for p in probs))

    # row 1: reversed, and scaled by a power of two (exact), as the sampler passes
    # unnormalised exp(logit - max) weights
    t = torch.tensor([probs, [8 * p for p in probs[::-1]]], dtype=torch.float32)  # [2, vocab]
    out = filter_probs_(
        t.clone(),
        torch.tensor([top_k] * 2) if which in ("k", "all") else None,
        torch.tensor([top_p] * 2) if which in ("p", "all") else None,
        torch.tensor([min_p] * 2) if which in ("min_p", "all") else None,
        candidates=candidates,  # small: most rows need the full-sort fallback
    )
    want = kept_reference(probs, top_k, top_p, min_p)
    assert {i for i in range(vocab) if out[0, i] > 0} == want
    assert {vocab - 1 - i for i in range(vocab) if out[1, i] > 0} == want
    # survivors keep their probability; nothing is renormalised or moved
    assert torch.equal(out[out > 0], t[out > 0])


def test_top_p_applies_to_renormalised_top_k() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    # top_k=2 leaves {0.4, 0.3}; renormalised 0.4 / 0.7 = 0.57 >= 0.55, so one token stays
    out = filter_probs_(probs.clone(), torch.tensor([2]), torch.tensor([0.55]))
    assert (out > 0).tolist() == [[False, True, False, False]]
    out = filter_probs_(probs.clone(), None, torch.tensor([0.55]))  # without top_k: 0.4 + 0.3 needed
    assert (out > 0).tolist() == [[False, True, False, True]]


def test_exact_thresholds_are_inclusive() -> None:
    # Powers of two, so every sum and product below is exact in float32.
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    # cumulative 0.5, 0.75: the prefix reaching exactly top_p is enough
    out = filter_probs_(probs.clone(), None, torch.tensor([0.75]))
    assert (out > 0).tolist() == [[False, True, False, True]]
    # prob == min_p * max (0.25 == 0.5 * 0.5) stays
    out = filter_probs_(probs.clone(), None, None, torch.tensor([0.5]))
    assert (out > 0).tolist() == [[False, True, False, True]]


def test_top_p_one_keeps_everything_despite_rounding() -> None:
    # 1.0 - 1e-10 rounds to 1.0 in float32: a naive "tokens above hold < top_p" test drops the
    # tail. top_p = 1 rows must come out untouched when another row switches top_p on.
    probs = torch.tensor([[1.0, 1e-10, 1e-12], [0.5, 0.3, 0.2]])
    out = filter_probs_(probs.clone(), None, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], probs[0])


def test_filter_works_in_place() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert filter_probs_(probs, torch.tensor([1])) is probs
    assert probs.tolist() == [[0.5, 0.0, 0.0]]


def test_sampler_leaves_logits_untouched() -> None:
    logits = torch.randn(3, 40)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 50}),
        SamplingParams(top_p=0.5, repetition_penalty=1.5, min_new_tokens=2),
        SamplingParams(temperature=0.3, frequency_penalty=1.0, top_k=4),
    ]
    info = SamplingBatchInfo.build(params, [[1, 2], [3], [4, 4]], 40, EOS, "cpu")
    Sampler()(logits, info)
    assert torch.equal(logits, before)


def test_top_p_tiny_keeps_one_token() -> None:
    out = filter_probs_(torch.tensor([[0.25, 0.25, 0.5]]), None, torch.tensor([1e-6]))
    assert (out > 0).tolist() == [[False, False, True]]


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({"top_k": 3}, {7, 2, 5}),
        ({"top_p": 0.6}, {7, 2}),  # 0.35 < 0.6 <= 0.35 + 0.255
        ({"min_p": 0.5}, {7, 2}),  # prob >= 0.175
        ({"top_k": 4, "min_p": 0.4}, {7, 2, 5}),  # 0.15 >= 0.14, 0.10 < 0.14
    ],
)
def test_sampled_tokens_stay_in_the_kept_set(kwargs: dict, want: set[int]) -> None:
    probs = torch.full((8,), 0.0375)  # three tail tokens share what is left
    probs[[7, 2, 5, 1, 4]] = torch.tensor([0.35, 0.255, 0.15, 0.10, 0.0325])
    logits = probs.log().expand(2000, 8)
    torch.manual_seed(0)
    got = sample([SamplingParams(**kwargs)] * 2000, logits)
    assert set(got.tolist()) == want  # never outside, and every kept token shows up


def test_sampling_follows_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).expand(10000, 4)
    torch.manual_seed(0)
    for temperature in (1.0, 0.5, 2.0):
        got = sample([SamplingParams(temperature=temperature)] * 10000, logits)
        freq = torch.bincount(got, minlength=4).float() / got.numel()
        want = torch.softmax(logits[0] / temperature, dim=-1)
        # 5 standard errors of a binomial frequency at n = 10000
        assert torch.all((freq - want).abs() < 5 * (want * (1 - want) / 10000).sqrt() + 1e-3)


def test_ties_at_the_boundary_all_stay() -> None:
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    out = filter_probs_(probs, torch.tensor([2]), candidates=3)
    assert (out > 0).tolist() == [[True, True, True, True, False]]


def test_sampling_over_chunks_follows_probs() -> None:
    # vocab spans several sampling chunks, the last one short; mass sits in three chunks
    vocab, n = 3000, 5000
    probs = torch.zeros(vocab)
    probs[[5, 1500, 2999]] = torch.tensor([0.3, 0.2, 0.4])
    probs[2000:2100] = 0.001  # 0.1 spread thin
    torch.manual_seed(0)
    got = sample_from_probs(probs.expand(n, vocab), draw_uniforms(n, None, "cpu"))
    assert set(got.tolist()) <= set(probs.nonzero().flatten().tolist())
    counts = torch.bincount(got, minlength=vocab).double()
    buckets = torch.stack([counts[5], counts[1500], counts[2999], counts[2000:2100].sum()]) / n
    want = torch.tensor([0.3, 0.2, 0.4, 0.1], dtype=torch.float64)
    assert torch.all((buckets - want).abs() < 5 * (want * (1 - want) / n).sqrt())


def test_extreme_uniforms_never_pick_zero_probability() -> None:
    vocab = 2 * 1024 + 7
    probs = torch.zeros(4, vocab)
    probs[:, 3] = 1e-30  # a lone, tiny nonzero token in the first chunk
    probs[:, 1500] = 1e-30  # and one in the second; chunk 3 is all zeros
    # u = 1.0 stands in for a u * total that rounds up to total (possible for u just below 1)
    top = 1.0
    u = torch.tensor([[0.0, 0.0], [top, top], [0.0, top], [top, 0.0]], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [3, 1500, 3, 1500]


# ---------------------------------------------------------------------- seeds
def _seeded_run(seed: int, steps: int, logits: torch.Tensor, row: int, others: list[SamplingParams]):
    """Tokens the seeded request draws over `steps` steps, placed at `row` among `others`."""
    tokens: list[int] = []
    for _ in range(steps):
        params = others[:row] + [SamplingParams(seed=seed, top_p=0.95)] + others[row:]
        history = [[] for _ in params]
        history[row] = list(tokens)
        batch_logits = torch.randn(len(params), logits.shape[0])
        batch_logits[row] = logits
        tokens.append(int(sample(params, batch_logits, history)[row]))
    return tokens


def test_seed_reproduces_independent_of_batch() -> None:
    logits = torch.randn(64) * 0.5  # flat-ish, so draws vary from step to step
    torch.manual_seed(1)
    alone = _seeded_run(7, 12, logits, 0, [])
    torch.manual_seed(2)  # the global RNG must not matter either
    crowded = _seeded_run(
        7,
        12,
        logits,
        2,
        [SamplingParams(top_k=3), SamplingParams(temperature=0.0), SamplingParams(min_p=0.3)]
        + [SamplingParams(seed=8)],
    )
    assert alone == crowded
    assert len(set(alone)) > 1  # the step enters the seed: not one token repeated
    assert _seeded_run(8, 12, logits, 0, []) != alone


def test_seeded_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(4000, 4)
    params = [SamplingParams(seed=s) for s in range(4000)]
    got = sample(params, logits, [[] for _ in params])
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert torch.all((freq - probs).abs() < 0.04)
