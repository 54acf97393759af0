"""Pooling of the final hidden states into one embedding per request (--is-embedding).

Two halves, because a prompt may be computed over several steps (chunked prefill):

    pool_step()   in the forward, per step: what this step contributes for each request
                  last -> the hidden row of the request's last token in this step
                  mean -> the sum of the request's rows in this step (float32)
    finalize()    in the scheduler, once the prompt is done: mean divides the accumulated sum by
                  the prompt length; both are L2-normalised (what Qwen3-Embedding / e5 / gte do)

Last-token pooling needs only the last chunk (an earlier chunk's value is simply replaced); mean
pooling sums every chunk. A radix-cache hit skips the cached prefix's rows, which mean pooling needs,
so under mean pooling a request never reuses a cached prefix (Req.reuse_prefix; see docs/embeddings.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.server_args import POOLING_METHODS

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


def pool_step(hidden: torch.Tensor, fb: ForwardBatch, pooling: str) -> torch.Tensor:
    """[n_tokens, hidden] -> [bs, hidden] float64: this step's part of each request's pooled vector
    (float64 so that a mean over thousands of rows adds no error of its own)."""
    if pooling == "last":
        return hidden[fb.extend_start_loc + fb.extend_seq_lens - 1].double()
    if pooling == "mean":
        req_of_row = torch.repeat_interleave(torch.arange(fb.batch_size, device=hidden.device), fb.extend_seq_lens)
        sums = torch.zeros(fb.batch_size, hidden.shape[1], dtype=torch.float64, device=hidden.device)
        return sums.index_add_(0, req_of_row, hidden.double())
    raise ValueError(f"pooling: must be one of {POOLING_METHODS}, got {pooling!r}")


def accumulate(acc: torch.Tensor | None, part: torch.Tensor, pooling: str) -> torch.Tensor:
    """One request's running value after one more step (chunk) of its prompt."""
    return part if acc is None or pooling == "last" else acc + part


def finalize(acc: torch.Tensor, num_tokens: int, pooling: str, normalize: bool = True) -> list[float]:
    """The request's embedding: mean (if asked) then L2-normalised, as a list of floats. normalize False: a
    classifier's logits (models/base.py CausalLM.score), returned as they are."""
    vec = acc / num_tokens if pooling == "mean" else acc
    return (torch.nn.functional.normalize(vec, dim=0) if normalize else vec).tolist()
