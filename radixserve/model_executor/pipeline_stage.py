"""PipelineStage: one step of a pipeline-parallel forward, as one stage runs it.

    stage 0                    stage 1 ...                   last stage
    embed + its layers  ---->  its layers  ---->  ...  --->  its layers, norm, LM head, sample
            send [hidden | residual | status]                         |
                                                                      v
    every rank  <-----------  StepResult (tokens, logprobs), broadcast from the last stage's TP rank 0

Every rank runs the same scheduler on rank 0's broadcast inputs (managers/scheduler_process.py), so
every stage already holds this step's ForwardBatch: the batch layout never travels, a stage sizes its
receive buffer from its own batch ([num_tokens, hidden] twice), and its KV goes to the same slots as
every other stage's. Only activations go forward and only the sampled result comes back, to every rank,
because every scheduler must append the same tokens (as with tensor parallel, where rank 0's tokens win).

No micro-batching: a stage waits while the others compute, so pp_size stages take about the sum of
their times per step (on one machine pipeline parallel buys memory, not speed; see the README).

Failures stay identical on every rank: a stage whose forward raises still sends (status 1, then the
error text), the stages after it skip their compute, the last stage puts the error in the StepResult,
and every rank raises the same exception, so FailureIsolation bisects the batch the same way everywhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from radixserve.model_executor.results import GenerationBatchResult, SampleOutput

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ERROR_TEXT_BYTES = 4096  # a failed stage's error message, sent after its status (truncated to this)


@dataclass
class StepResult:
    """What the last stage shares with every rank after a step (plain lists: pickled once, on gloo)."""

    next_token_ids: list[int] | None = None
    next_token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    input_token_logprobs: list[list[float] | None] | None = None
    token_ids_logprobs: list[list[float] | None] | None = None
    accept_lens: list[int] | None = None  # TARGET_VERIFY: drafts kept per request (the last stage's rule)
    error: str | None = None  # set when a stage failed this step: every rank raises it
    out_of_memory: bool = False  # the failure was a MemoryError (fatal: FailureIsolation stops the server)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise (MemoryError if self.out_of_memory else RuntimeError)(self.error)


class PipelineStage:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.ps = runner.parallel_state
        self.hidden_size = runner.model_config.hidden_size
        self.where = self.ps.layout.describe(self.ps.rank)

    def forward_and_sample(self, fb: ForwardBatch, t0: float) -> GenerationBatchResult:
        ps, tm = self.ps, self.runner.timers
        t1 = time.perf_counter()
        tm["forward_batch_init_s"] += t1 - t0
        proxy, error = (None, None) if ps.is_first_stage else self._recv(fb.num_tokens)
        t2 = time.perf_counter()
        out = None
        if error is None:
            try:
                out = self.runner.forward(fb, proxy)
            except Exception as e:
                error = self._failed(e, "forward")
        t3 = time.perf_counter()
        tm["forward_s"] += t3 - t2
        local = None
        if not ps.is_last_stage:
            self._send(out, error, fb.num_tokens)
        else:
            local = self._sample(out, fb, error)
        t4 = time.perf_counter()
        result: StepResult = ps.broadcast_object(local[1] if local else None, src=ps.last_stage_rank)
        tm["pp_recv_s"] = tm.get("pp_recv_s", 0.0) + t2 - t1
        tm["pp_send_or_sample_s"] = tm.get("pp_send_or_sample_s", 0.0) + t4 - t3
        tm["pp_result_s"] = tm.get("pp_result_s", 0.0) + time.perf_counter() - t4
        result.raise_if_failed()
        if local is not None:
            return GenerationBatchResult(local[0], local[2], fb)
        sample = SampleOutput(torch.tensor(result.next_token_ids, dtype=torch.int64), result.next_token_logprobs,
                              result.top_logprobs, accept_lens=result.accept_lens,
                              token_ids_logprobs=result.token_ids_logprobs)
        logits = LogitsProcessorOutput(next_token_logits=torch.empty(0, self.runner.model_config.vocab_size),
                                       input_token_logprobs=result.input_token_logprobs)
        return GenerationBatchResult(logits, sample, fb)

    # ------------------------------------------------------------------ last stage
    def _sample(self, out: LogitsProcessorOutput | None, fb: ForwardBatch, error: str | None):
        """(logits, StepResult, SampleOutput) on the last stage; the StepResult carries any stage's error."""
        if error is not None:
            return None, self._error_result(error), None
        try:
            t = time.perf_counter()
            sample = self.runner.sample(out, fb)
            self.runner.timers["sample_s"] += time.perf_counter() - t
        except Exception as e:
            return None, self._error_result(self._failed(e, "sampling")), None
        result = StepResult(sample.next_token_ids.tolist(), sample.next_token_logprobs, sample.top_logprobs,
                            out.input_token_logprobs, sample.token_ids_logprobs, sample.accept_lens)
        return out, result, sample

    @staticmethod
    def _error_result(error: str) -> StepResult:
        return StepResult(error=error, out_of_memory=error.startswith("MemoryError"))

    def _failed(self, e: Exception, what: str) -> str:
        logger.exception("%s: %s failed", self.where, what)
        return f"{type(e).__name__}: {e} ({what} on {self.where})"

    # ------------------------------------------------------------------ activations
    def _send(self, out: PPProxyTensors | None, error: str | None, num_tokens: int) -> None:
        """One message per step: [hidden | residual | status] flat; the error text follows on failure."""
        n = num_tokens * self.hidden_size
        buf = torch.zeros(2 * n + 1, dtype=self.runner.act_dtype, device=self.runner.device)
        if error is None:
            buf[:n].view(num_tokens, self.hidden_size).copy_(out.hidden_states)
            buf[n : 2 * n].view(num_tokens, self.hidden_size).copy_(out.residual)
        else:
            buf[-1] = 1.0
        self.ps.send_to_next(buf)
        if error is not None:
            text = torch.zeros(ERROR_TEXT_BYTES, dtype=torch.uint8)
            raw = error.encode()[:ERROR_TEXT_BYTES]
            text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.ps.send_to_next(text.to(self.runner.device))

    def _recv(self, num_tokens: int) -> tuple[PPProxyTensors | None, str | None]:
        n = num_tokens * self.hidden_size
        buf = torch.empty(2 * n + 1, dtype=self.runner.act_dtype, device=self.runner.device)
        self.ps.recv_from_prev(buf)
        if buf[-1].item() != 0:
            text = self.ps.recv_from_prev(torch.empty(ERROR_TEXT_BYTES, dtype=torch.uint8, device=self.runner.device))
            return None, bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        # [num_tokens, hidden] views of one buffer: no copies
        hidden = buf[:n].view(num_tokens, self.hidden_size)
        residual = buf[n : 2 * n].view(num_tokens, self.hidden_size)
        return PPProxyTensors(hidden, residual), None
