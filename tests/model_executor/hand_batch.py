"""Drive a real ModelRunner by hand: allocate rows and KV slots through the real pools and
build ModelWorkerBatches explicitly (the scheduler's job, written out for execution tests)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from radixserve.mem_cache.request_slots import RequestSlots
from radixserve.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode, ModelWorkerBatch
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.speculative.spec_info import VerifyInput

GREEDY = SamplingParams(temperature=0.0)


class HandBatch:
    def __init__(self, runner) -> None:
        self.r = runner
        self.slots = RequestSlots(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        self.rows: dict[int, list[int]] = {}  # row -> tokens whose KV is written

    def new_req(self) -> int:
        row = self.slots.take_row()
        assert row is not None
        self.rows[row] = []
        return row

    def release(self, row: int) -> None:
        self.slots.free_row(row, 0, len(self.rows.pop(row)))

    def release_all(self) -> None:
        for row in list(self.rows):
            self.release(row)

    def run(self, items: list[tuple[int, list[int]]], mode: ForwardMode | None = None, full: bool = True):
        """items: (row, new tokens). Each request's prefix is whatever the row already holds."""
        prefix_lens = [len(self.rows[row]) for row, _ in items]
        seq_lens = [p + len(new) for p, (_, new) in zip(prefix_lens, items)]
        locs = self.slots.alloc([row for row, _ in items], prefix_lens, seq_lens)
        assert locs is not None, "test pool too small"
        for row, new in items:
            self.rows[row].extend(new)
        if mode is None:
            if all(len(new) == 1 and p > 0 for (_, new), p in zip(items, prefix_lens)):
                mode = ForwardMode.DECODE
            else:
                mode = ForwardMode.PREFILL if not any(prefix_lens) else ForwardMode.EXTEND
        verify = mode.is_target_verify()
        mwb_ids = [t for _, new in items for t in new]
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=mwb_ids,
            req_pool_indices=[row for row, _ in items],
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            out_cache_loc=locs,
            # one row per request; TARGET_VERIFY: per verified position (each request's rows after the
            # first are its drafts: greedy, point-mass)
            sampling_params=[GREEDY] * (len(mwb_ids) if verify else len(items)),
            spec_info=VerifyInput([len(new) - 1 for _, new in items], [None] * len(items)) if verify else None,
            capture_hidden_mode=CaptureHiddenMode.FULL if full else CaptureHiddenMode.NULL,
        )
        return self.r.forward_batch_generation(mwb)

    def all_logprobs(self, result) -> torch.Tensor:
        """log-softmax at every computed position: [n_tokens, vocab], by the LM head kernels the runner's steps use
        (a low-bit runner's tied LM head has no float copy: its embedding is read from the mapped file)."""
        model = self.r.model
        step = SimpleNamespace(kernel_mode=self.r.kernel_mode)  # what step_kernels reads of a ForwardBatch
        logits = model.logits_processor.compute_logits(result.logits_output.hidden_states, model.lm_head, step)
        return torch.log_softmax(logits.float(), dim=-1)

    @staticmethod
    def split(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
        return list(torch.split(x, lens))
