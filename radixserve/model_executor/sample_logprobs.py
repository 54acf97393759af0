"""The logprobs a step returns beside its tokens (ModelRunner.sample): under the raw distribution, before the
sampler's penalties and temperature."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.results import SampleOutput


def add_logprobs(out: SampleOutput, logprobs: torch.Tensor, fb: ForwardBatch, deterministic: bool) -> None:
    """The chosen tokens' logprobs, each row's top ones and its asked-for ids' (token_ids_logprob), under the raw
    distribution (log_softmax over [bs, vocab] is row-wise in ATen, bit-identical at every bs: no per-row loop)."""
    if fb.token_ids_logprobs:
        out.token_ids_logprobs = [None if ids is None else logprobs[i, ids].tolist()
                                  for i, ids in enumerate(fb.token_ids_logprobs)]
    if not fb.return_logprob:
        return
    out.next_token_logprobs = logprobs.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1).tolist()
    nums = fb.top_logprobs_nums
    k = max(nums, default=0)
    if k > 0 and deterministic:
        # each row's own k: the order topk gives tied values may depend on k
        rows = [logprobs[i : i + 1].topk(n, dim=-1) for i, n in enumerate(nums)]
        out.top_logprobs = [list(zip(ids[0].tolist(), vals[0].tolist())) for vals, ids in rows]
    elif k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        out.top_logprobs = [list(zip(ids[i, :n].tolist(), vals[i, :n].tolist())) for i, n in enumerate(nums)]
