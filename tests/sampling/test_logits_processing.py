"""SamplingBatchInfo.build and apply_logits_processing against a per-element reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo, step_seed
from radixserve.sampling.sampling_params import SamplingParams

EOS = [1, 3]


def reference(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]] | None,
    prompt_ids: list[list[int]] | None,
    eos: list[int],
) -> torch.Tensor:
    """The spec, one element at a time, in float64."""
    out = logits.to(torch.float64).clone()
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        hist = output_ids[i] if output_ids is not None else []
        seen = set(hist) | set(prompt_ids[i] if prompt_ids is not None else [])
        held_back = len(hist) < p.min_new_tokens
        for v in range(vocab):
            x = float(out[i, v])
            if v in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            c = hist.count(v)
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            x += p.logit_bias.get(v, 0.0)
            if held_back and (v in p.stop_token_ids or (v in eos and not p.ignore_eos)):
                x = -math.inf
            out[i, v] = x
    return out.to(torch.float32)


def process(
    params: list[SamplingParams],
    logits: torch.Tensor,
    output_ids: list[list[int]] | None,
    prompt_ids: list[list[int]] | None = None,
) -> torch.Tensor:
    info = SamplingBatchInfo.build(params, output_ids, logits.shape[1], EOS, "cpu", prompt_ids)
    return info.apply_logits_processing(logits.clone())


@st.composite
def batches(draw: st.DrawFn):
    vocab = draw(st.integers(4, 24))
    bs = draw(st.integers(1, 5))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    params = [
        SamplingParams(
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, -1.5, 0.4, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, 0.7, -2.0])),
            logit_bias=draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=3)),
            min_new_tokens=draw(st.integers(0, 4)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
        )
        for _ in range(bs)
    ]
    output_ids = draw(st.none() | st.lists(tokens, min_size=bs, max_size=bs))
    prompt_ids = draw(st.none() | st.lists(tokens, min_size=bs, max_size=bs))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(bs, vocab, generator=gen) * 5  # both signs, for repetition_penalty
    return params, logits, output_ids, prompt_ids


@settings(max_examples=30, deadline=None)
@given(batches())
def test_matches_reference(batch) -> None:
    params, logits, output_ids, prompt_ids = batch
    got = process(params, logits, output_ids, prompt_ids)
    want = reference(logits, params, output_ids, prompt_ids, EOS)
    # isclose treats equal infinities as close (the min_new_tokens mask)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got, want)


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.0, 5.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    got = process(params, logits, [[1, 4]], prompt_ids=[[0, 0]])
    assert got.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.0, 5.0]]
    # without prompts only generated tokens count
    got = process(params, logits, [[1, 4]], prompt_ids=None)
    assert got.tolist() == [[2.0, -4.0, 2.0, -2.0, 0.0, 5.0]]


def test_frequency_and_presence_penalty() -> None:
    logits = torch.zeros(1, 6)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    got = process(params, logits, [[2, 2, 2, 4]])
    assert got.tolist() == [[0.0, 0.0, -1.75, 0.0, -0.75, 0.0]]


def test_penalties_ignore_prompt_for_frequency_and_apply_in_order() -> None:
    # repetition first, then frequency: 2 / 2 - 1 = 0 (the other order would give 0.5)
    logits = torch.full((1, 6), 2.0)
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)]
    got = process(params, logits, [[5]], prompt_ids=[[0]])
    assert got.tolist() == [[1.0, 2.0, 2.0, 2.0, 2.0, 0.0]]


def test_logit_bias_adds_per_row() -> None:
    logits = torch.zeros(2, 6)
    params = [SamplingParams(logit_bias={"2": 3.5, "5": -100}), SamplingParams(logit_bias={0: 1})]
    got = process(params, logits, None)
    assert got.tolist() == [[0, 0, 3.5, 0, 0, -100], [1, 0, 0, 0, 0, 0]]


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 8)
    p = SamplingParams(min_new_tokens=3, stop_token_ids=[6])
    for n_out, masked in [(0, {1, 3, 6}), (2, {1, 3, 6}), (3, set()), (5, set())]:
        got = process([p], logits, [[0] * n_out])[0]
        assert {i for i in range(8) if got[i] == -math.inf} == masked
    # output_ids unknown counts as nothing generated yet
    got = process([p], logits, None)[0]
    assert {i for i in range(8) if got[i] == -math.inf} == {1, 3, 6}


def test_min_new_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    # EOS cannot end an ignore_eos request, but a stop token id still would.
    logits = torch.zeros(2, 8)
    params = [
        SamplingParams(min_new_tokens=2, ignore_eos=True, stop_token_ids=[6]),
        SamplingParams(min_new_tokens=2, ignore_eos=True),
    ]
    got = process(params, logits, [[], []])
    assert [{i for i in range(8) if row[i] == -math.inf} for row in got] == [{6}, set()]


def test_default_params_do_no_processing() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.3, top_p=0.9, top_k=5, min_p=0.1)]
    info = SamplingBatchInfo.build(params, None, 10, EOS, "cpu")
    assert not info.needs_logits_processing
    assert info.repetition is info.frequency_presence is info.logit_bias is None
    assert info.min_tokens_mask is None and info.seeded_rows is None
    logits = torch.randn(2, 10)
    before = logits.clone()
    assert info.apply_logits_processing(logits) is logits
    assert torch.equal(logits, before)


def test_out_of_vocab_history_tokens_are_ignored() -> None:
    logits = torch.ones(1, 4)
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)]
    got = process(params, logits, [[2, 9]], prompt_ids=[[-1, 100, 0]])
    assert got.tolist() == [[0.5, 1.0, -0.5, 1.0]]


def test_needs_history() -> None:
    assert not SamplingBatchInfo.needs_history([SamplingParams(), SamplingParams(logit_bias={1: 2})])
    for kwargs in [
        {"frequency_penalty": 0.1},
        {"presence_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"min_new_tokens": 1},
        {"seed": 0},
    ]:
        assert SamplingBatchInfo.needs_history([SamplingParams(), SamplingParams(**kwargs)])


def test_build_tensors_and_flags() -> None:
    vocab = 10
    params = [
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=1),  # greedy
        SamplingParams(temperature=0.5, top_k=50),  # top_k >= vocab is off
        SamplingParams(temperature=0.7, top_k=4, seed=9),
    ]
    info = SamplingBatchInfo.build(params, [[], [5], [5, 6]], vocab, EOS, "cpu")
    assert info.temperatures.shape == (3, 1) and info.temperatures.dtype == torch.float32
    assert info.temperatures.flatten().tolist() == pytest.approx([1.0, 0.5, 0.7])
    # greedy rows hold neutral filters; top_k >= vocab is off
    assert info.top_ks.dtype == torch.int64 and info.top_ks.tolist() == [vocab, vocab, 4]
    assert info.top_ps.tolist() == [1.0] * 3 and info.min_ps.tolist() == [0.0] * 3
    assert info.is_greedy.tolist() == [True, False, False]
    assert not info.all_greedy and info.any_greedy
    # the greedy row's top_p / min_p never switch the filters on
    assert info.need_top_k and not info.need_top_p and not info.need_min_p
    assert info.seeded_rows == [(2, step_seed(9, 2))]
    with pytest.raises(ValueError, match="output_ids"):
        SamplingBatchInfo.build(params, [[]], vocab, EOS, "cpu")


def test_step_seed_is_stable_and_spreads() -> None:
    assert step_seed(42, 7) == step_seed(42, 7)
    seeds = {step_seed(s, t) for s in range(20) for t in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert 0 <= step_seed(-5, 0) < 2**63 and 0 <= step_seed(2**80, 3) < 2**63
