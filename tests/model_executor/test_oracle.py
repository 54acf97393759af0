"""The real model against transformers loaded from the same GGUF (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.hand_batch import HandBatch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 1, 2, 3, 5, 8,",
]
# Q4_1 weights are dequantised identically on both sides; the remaining differences are float32
# summation order (SDPA vs eager attention, fused vs separate projections): ~1e-5 in log-space.
TOL = 1e-3


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_prefill_logits_match_transformers_at_every_position(model_runner, hf_oracle, prompt_ids):
    hb = HandBatch(model_runner)
    rows = [hb.new_req() for _ in prompt_ids]
    res = hb.run(list(zip(rows, prompt_ids)))  # one PREFILL batch of 5 prompts
    ours = hb.split(hb.all_logprobs(res), [len(p) for p in prompt_ids])
    hb.release_all()
    for ids, mine in zip(prompt_ids, ours):
        with torch.no_grad():
            ref = torch.log_softmax(hf_oracle(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert mine.shape == ref.shape
        diff = (mine - ref).abs().max().item()
        assert diff <= TOL, f"max |logprob diff| {diff:.2e} for prompt {ids[:8]}..."


def test_greedy_decode_matches_transformers(model_runner, hf_oracle, prompt_ids):
    n_new = 32
    hb = HandBatch(model_runner)
    rows = [hb.new_req() for _ in prompt_ids]
    res = hb.run(list(zip(rows, prompt_ids)), full=False)
    outs = [[t] for t in res.sample_output.next_token_ids.tolist()]
    for _ in range(n_new - 1):  # DECODE steps, all five requests in one batch
        res = hb.run([(row, [o[-1]]) for row, o in zip(rows, outs)], full=False)
        for o, t in zip(outs, res.sample_output.next_token_ids.tolist()):
            o.append(t)
    hb.release_all()
    for ids, mine in zip(prompt_ids, outs):
        with torch.no_grad():
            ref = hf_oracle.generate(
                torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert mine == ref
