"""Every forward mode computes the same function: each is checked against PREFILL/DECODE on the
real model, for page_size 1 and 16."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.forward_batch_info import ForwardMode
from tests.model_executor.hand_batch import HandBatch

TOL = 2e-4  # float32 summation-order differences between the attention paths


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runner(request, make_runner):
    return make_runner(page_size=request.param, max_total_tokens=8192)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = ("Radix trees share prefixes between requests, so a long system prompt is computed once "
            "and every later request that starts with it reads the cached keys and values.")
    return tokenizer.encode(text, add_special_tokens=False)


def full_prefill(hb: HandBatch, ids: list[int]) -> torch.Tensor:
    row = hb.new_req()
    lp = hb.all_logprobs(hb.run([(row, ids)]))
    hb.release(row)
    return lp


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"max |logprob diff| {diff:.2e}"


@pytest.mark.parametrize("split", [1, 7, 16, 23])
def test_extend_after_cached_prefix_equals_prefill(runner, prompt, split):
    hb = HandBatch(runner)
    ref = full_prefill(hb, prompt)
    row = hb.new_req()
    hb.run([(row, prompt[:split])])
    res = hb.run([(row, prompt[split:])])
    assert res.forward_batch.forward_mode == ForwardMode.EXTEND
    close(hb.all_logprobs(res), ref[split:])
    hb.release_all()


def test_prompt_in_three_chunks_equals_prefill(runner, prompt):
    hb = HandBatch(runner)
    ref = full_prefill(hb, prompt)
    row = hb.new_req()
    a, b = len(prompt) // 3, 2 * len(prompt) // 3
    parts = [hb.all_logprobs(hb.run([(row, prompt[s:e])])) for s, e in [(0, a), (a, b), (b, len(prompt))]]
    close(torch.cat(parts), ref)
    hb.release_all()


def test_decode_step_equals_prefill_position(runner, prompt):
    hb = HandBatch(runner)
    ref = full_prefill(hb, prompt)
    row = hb.new_req()
    hb.run([(row, prompt[:-3])])
    for pos in range(len(prompt) - 3, len(prompt)):
        res = hb.run([(row, [prompt[pos]])])
        assert res.forward_batch.forward_mode == ForwardMode.DECODE
        close(hb.all_logprobs(res)[0], ref[pos])
    hb.release_all()


def test_mixed_batch_equals_requests_run_separately(runner, prompt):
    hb = HandBatch(runner)
    ref = full_prefill(hb, prompt)
    ext_row, dec_row, fresh_row = hb.new_req(), hb.new_req(), hb.new_req()
    hb.run([(ext_row, prompt[:10]), (dec_row, prompt[:-1])])
    # one MIXED forward: an EXTEND chunk, a DECODE token, and a brand-new prompt
    res = hb.run(
        [(ext_row, prompt[10:20]), (dec_row, prompt[-1:]), (fresh_row, prompt[:5])], mode=ForwardMode.MIXED
    )
    ext_lp, dec_lp, fresh_lp = hb.split(hb.all_logprobs(res), [10, 1, 5])
    close(ext_lp, ref[10:20])
    close(dec_lp[0], ref[-1])
    close(fresh_lp, ref[:5])
    # the sampled tokens are the argmax at each request's last position
    expect = torch.stack([ref[19], ref[-1], ref[4]]).argmax(-1)
    assert res.sample_output.next_token_ids.tolist() == expect.tolist()
    hb.release_all()


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_target_verify_equals_single_decode_steps(runner, make_runner, prompt, backend):
    # three requests verifying different numbers of drafts (4, none: a plain one-row member, 2); the
    # paged kernel takes each row as a one-token query, SDPA one padded block per request
    if backend != "auto":
        runner = make_runner(page_size=runner.server_args.page_size, max_total_tokens=2048, attention_backend=backend)
    hb = HandBatch(runner)
    ref = full_prefill(hb, prompt)
    widths = [5, 1, 3]
    starts = [len(prompt) - 5, len(prompt) - 11, len(prompt) - 20]
    rows = [hb.new_req() for _ in widths]
    hb.run([(r, prompt[:s]) for r, s in zip(rows, starts)])
    res = hb.run([(r, prompt[s : s + w]) for r, s, w in zip(rows, starts, widths)], mode=ForwardMode.TARGET_VERIFY)
    verify_lp = hb.split(hb.all_logprobs(res), widths)
    # the same positions, one DECODE step at a time, in fresh rows
    for s, w, lp in zip(starts, widths, verify_lp):
        row = hb.new_req()
        hb.run([(row, prompt[:s])])
        steps = [hb.all_logprobs(hb.run([(row, [prompt[p]])]))[0] for p in range(s, s + w)]
        close(lp, torch.stack(steps))
        close(lp, ref[s : s + w])
    assert res.logits_output.next_token_logits.shape[0] == sum(widths)
    # greedy verification keeps the drafts (the prompt's own next tokens) the target's argmax agrees with
    expect = []
    for s, w in zip(starts, widths):
        a = 0
        while a < w - 1 and int(ref[s + a].argmax()) == prompt[s + a + 1]:
            a += 1
        expect.append(a)
    assert res.sample_output.accept_lens == expect
    hb.release_all()


def test_batch_of_different_lengths_equals_each_alone(runner, prompt):
    hb = HandBatch(runner)
    lens = [3, len(prompt), 17]
    alone = [full_prefill(hb, prompt[:n]) for n in lens]
    rows = [hb.new_req() for _ in lens]
    res = hb.run([(r, prompt[:n]) for r, n in zip(rows, lens)])
    for mine, ref in zip(hb.split(hb.all_logprobs(res), lens), alone):
        close(mine, ref)
    # and a batched decode step of the three against the reference positions
    nxt = [prompt[n] if n < len(prompt) else prompt[0] for n in lens]
    res = hb.run([(r, [t]) for r, t in zip(rows, nxt)])
    dec = hb.all_logprobs(res)
    for i, n in enumerate(lens):
        if n < len(prompt):
            close(dec[i], full_prefill(hb, prompt[: n + 1])[-1])
    hb.release_all()
