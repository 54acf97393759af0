"""The execution step of an embedding server (--is-embedding): ForwardBatch -> decoder -> final norm ->
pooled rows. The LM head and the sampler never run (for a 135M model the LM head is a third of the
prefill's FLOPs), and the attention path, KV writes and paged cache are the generation step's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.pooler import pool_step
from radixserve.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch
from radixserve.model_executor.results import SampleOutput

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner


@dataclass
class EmbeddingBatchResult:
    pooled: torch.Tensor  # [bs, hidden] ([bs, num_labels]: a classifier's logits) float64: this step's part of each request's vector (layers/pooler.py)
    forward_batch: ForwardBatch
    # no tokens are sampled; kept empty so that the step log and the tracer read every result alike
    sample_output: SampleOutput


@torch.inference_mode()
def forward_embedding(runner: ModelRunner, batch: ModelWorkerBatch, pooling: str) -> EmbeddingBatchResult:
    if batch.forward_mode.is_decode() or batch.forward_mode.is_target_verify():
        raise ValueError(f"an embedding step is a prefill, got {batch.forward_mode.name}")
    t0 = time.perf_counter()
    fb = ForwardBatch.init_new(batch, runner)
    t1 = time.perf_counter()
    # the DecoderModel (models/base.py): embedding -> layers -> final norm, without the LM head; the runner's
    # kernel choices come with fb (ForwardBatch.kernel_mode)
    hidden = runner.model.model(fb.input_ids, fb.positions, fb)
    pooled = pool_step(hidden, fb, pooling)
    if getattr(runner.model, "score", None) is not None:
        # a sequence classifier (--pooling last): its last token's logits over the labels; the pooled row is the
        # hidden row widened exactly to float64, so the head computes in the model's own dtype as transformers does
        pooled = runner.model.score(pooled.to(hidden.dtype)).double()  # [bs, num_labels]
    runner.timers["forward_batch_init_s"] += t1 - t0
    runner.timers["forward_s"] += time.perf_counter() - t1
    empty = torch.empty(0, dtype=torch.int64)
    return EmbeddingBatchResult(pooled.cpu(), fb, SampleOutput(next_token_ids=empty))
