"""LogitsProcessor: hidden states -> the logits the sampler needs, and prompt logprobs on request.

Which rows get logits depends on the mode (the LM head is the single largest matrix of a small
model, so computing it for every prompt token would dominate prefill):

    DECODE          every row (one per request)
    TARGET_VERIFY   every row (1 + its drafts per request: each draft position is checked)
    PREFILL/EXTEND  the last row of each request    rows = extend_start_loc + extend_seq_lens - 1
    MIXED           the same rule (a decode request's only row is its last)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.model_executor.forward_batch_info import CaptureHiddenMode

if TYPE_CHECKING:
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead
    from radixserve.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [bs, vocab] ([bs * (k+1), vocab] for TARGET_VERIFY)
    hidden_states: torch.Tensor | None = None  # per capture_hidden_mode
    # Per request: logprob of each prompt token that follows a position computed this step.
    input_token_logprobs: list[list[float] | None] | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, ps: ParallelState, final_logit_softcap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ps = ps
        self.softcap = final_logit_softcap  # Gemma 2: logits = cap * tanh(logits / cap)

    def compute_logits(self, hidden: torch.Tensor, lm_head: ParallelLMHead,
                       fb: ForwardBatch | None = None) -> torch.Tensor:
        """fb: the step (its runner's kernel choices); None: the float weights, exactly."""
        # [n, hidden] -> [n, V/tp] -> gathered [n, padded V] -> [n, V]
        logits = self.ps.all_gather(lm_head.local_logits(hidden, fb), dim=-1)[:, : self.vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, hidden: torch.Tensor, lm_head: ParallelLMHead, fb: ForwardBatch) -> LogitsProcessorOutput:
        mode = fb.forward_mode
        if mode.is_decode() or mode.is_target_verify():
            last = hidden
        else:
            last_idx = fb.extend_start_loc + fb.extend_seq_lens - 1
            last = hidden[last_idx]
        out = LogitsProcessorOutput(next_token_logits=self.compute_logits(last, lm_head, fb))
        if fb.capture_hidden_mode == CaptureHiddenMode.FULL:
            out.hidden_states = hidden
        elif fb.capture_hidden_mode == CaptureHiddenMode.LAST:
            out.hidden_states = last
        if mode.is_extend() and any(t is not None for t in fb.prompt_logprob_targets):
            out.input_token_logprobs = self._prompt_logprobs(hidden, lm_head, fb)
        return out

    def _prompt_logprobs(
        self, hidden: torch.Tensor, lm_head: ParallelLMHead, fb: ForwardBatch
    ) -> list[list[float] | None]:
        result: list[list[float] | None] = []
        starts = fb.extend_start_loc.tolist()
        for i, targets in enumerate(fb.prompt_logprob_targets):
            if targets is None:
                result.append(None)
                continue
            n = min(len(targets), fb.extend_seq_lens_cpu[i])
            values: list[float] = []
            # chunks of 512 rows keep the [rows, vocab] temporaries small
            for off in range(0, n, 512):
                rows = hidden[starts[i] + off : starts[i] + min(n, off + 512)]
                logprobs = torch.log_softmax(self.compute_logits(rows, lm_head, fb).float(), dim=-1)
                ids = torch.tensor(targets[off : off + rows.shape[0]], dtype=torch.int64, device=rows.device)
                values.extend(logprobs.gather(1, ids.clamp(min=0).unsqueeze(1)).squeeze(1).tolist())
            result.append(values)
        return result
