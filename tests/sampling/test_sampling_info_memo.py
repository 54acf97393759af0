"""SamplingInfoMemo: a decode stream's steps reuse one SamplingBatchInfo, and only while nothing differs."""

from __future__ import annotations

import dataclasses

import torch

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoMemo
from radixserve.sampling.sampling_params import SamplingParams

VOCAB = 50
EOS = [1]


def _same(a: SamplingBatchInfo, b: SamplingBatchInfo) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif dataclasses.is_dataclass(x):
            if repr(x) != repr(y):
                return False
        elif x != y:
            return False
    return True


def test_the_same_params_objects_get_the_same_info_and_it_equals_a_fresh_build() -> None:
    memo = SamplingInfoMemo()
    params = [SamplingParams(temperature=0.7, top_k=5, logit_bias={3: 2.0}), SamplingParams(temperature=0.0)]
    first = memo.build(params, None, VOCAB, EOS, "cpu")
    again = memo.build(list(params), None, VOCAB, EOS, "cpu")  # a new list of the same objects: a new step
    assert again is first
    assert _same(again, SamplingBatchInfo.build(params, None, VOCAB, EOS, "cpu"))


def test_anything_else_is_built_anew() -> None:
    memo = SamplingInfoMemo()
    a, b = SamplingParams(temperature=0.7), SamplingParams(temperature=0.9)
    first = memo.build([a, b], None, VOCAB, EOS, "cpu")
    # equal values in other objects (another request), another order, another size: built, and right
    twin = SamplingParams(temperature=0.7)
    for params in ([twin, b], [b, a], [a], [a, b, a]):
        info = memo.build(params, None, VOCAB, EOS, "cpu")
        assert info is not first
        assert _same(info, SamplingBatchInfo.build(params, None, VOCAB, EOS, "cpu"))


def test_a_step_with_history_prompts_or_a_grammar_mask_is_never_reused() -> None:
    """A seed's draw and min_new_tokens depend on the token count, penalties on the tokens: per step."""
    memo = SamplingInfoMemo()
    seeded = SamplingParams(temperature=0.8, seed=7, min_new_tokens=2)
    one = memo.build([seeded], [[5]], VOCAB, EOS, "cpu")
    two = memo.build([seeded], [[5, 6]], VOCAB, EOS, "cpu")
    assert one is not two and one.seeded_rows != two.seeded_rows
    assert one.min_tokens_mask is not None and two.min_tokens_mask is None
    plain = SamplingParams(temperature=0.8)
    memo.build([plain], None, VOCAB, EOS, "cpu")
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    masked = memo.build([plain], None, VOCAB, EOS, "cpu", vocab_mask=mask)
    assert masked.vocab_mask is mask
    assert memo.build([plain], None, VOCAB, EOS, "cpu").vocab_mask is None  # not the masked step's info
    pen = SamplingParams(temperature=0.8, repetition_penalty=1.3)
    with_prompt = memo.build([pen], None, VOCAB, EOS, "cpu", prompt_ids=[[4, 9]])
    assert memo.build([pen], None, VOCAB, EOS, "cpu", prompt_ids=[[4, 10]]) is not with_prompt
