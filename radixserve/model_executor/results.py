"""What one forward step gives back: SampleOutput (the sampler's) and GenerationBatchResult (the step's).

Beside forward_batch_info.py rather than in model_runner.py: pipeline_stage.py builds these results and
model_runner.py builds a PipelineStage, so neither module may import the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.logits_processor import LogitsProcessorOutput
    from radixserve.model_executor.forward_batch_info import ForwardBatch


@dataclass
class SampleOutput:
    # [bs] int64; TARGET_VERIFY: one per verified row (sum(1 + k_i)), of which each request's first
    # accept_lens[i] + 1 are the tokens it produced (layers/rejection_sampler.py)
    next_token_ids: torch.Tensor
    next_token_logprobs: list[float] | None = None  # logprob of the chosen token (raw distribution), per row
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row: [(token id, logprob)] * k
    # per row: the logprobs of its ForwardBatch.token_ids_logprobs ids, in their order (None: it asked none)
    token_ids_logprobs: list[list[float] | None] | None = None
    accept_lens: list[int] | None = None  # TARGET_VERIFY: drafts kept per request
    # ModelWorkerBatch.return_probs: [bs, vocab] the distribution each row was drawn from (a draft's q)
    probs: torch.Tensor | None = None


@dataclass
class GenerationBatchResult:
    logits_output: LogitsProcessorOutput
    sample_output: SampleOutput
    forward_batch: ForwardBatch
