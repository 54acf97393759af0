"""The per-step record, in the seed's debugging order, and --trace-batches FILE (one JSON line per step):

    1. "schedule": what the ScheduleBatch selected and why (rids, prefix/extend lengths, queue sizes,
                   why the requests still waiting wait)
    2. "forward":  what the ForwardBatch carried (mode, batch size, number of tokens, positions range;
                   the trace file adds input_ids, positions, seq_lens, out_cache_loc, ...)
    3. "timing":   how the step's time split (picking the batch, building the ForwardBatch, the forward,
                   sampling)
    4. "result":   what the ModelRunner produced (sampled ids; trace file only)

One record, two readers: StepRecord.capture() runs once per step (copies of small lists and a few
numbers, no tensor reads) and the scheduler keeps it in its StepLog ring (debug/step_log.py, what the
web dashboard shows); the BatchTracer writes the same record, plus the tensors, to the file.
`radixserve inspect FILE` reads the file back (debug/inspect.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from radixserve.managers.queue_state import QueueState
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.model_executor.results import GenerationBatchResult


@dataclass(slots=True)
class StepRecord:
    """One step as the scheduler saw it. Only what is cheap to copy is stored (the modes as enums, the
    batch's small lists); names and derived fields (extend lengths, positions range) are made in
    to_json(), off the hot path. capture() costs a few microseconds at batch 1."""

    step: int
    time: float  # wall clock (time.time()) when the forward returned
    mode: ForwardMode  # the ScheduleBatch's forward mode
    rids: list[str]
    prefix_lens: list[int]  # cached / already computed tokens per request
    seq_lens: list[int]  # prefix + this step's tokens per request
    chunked_rid: str | None
    num_waiting: int  # after this step's admission
    num_running: int  # the running (decoding) batch, not counting this step's new admissions
    wait_reason: str | None  # why the waiting requests were not admitted (Scheduler.wait_reason)
    kv_available: int
    kv_cached: int
    new_token_ratio: float
    spec_drafts: list[list[int]] | None  # TARGET_VERIFY: each request's drafts
    spec_accept_lens: list[int] | None  # TARGET_VERIFY: how many of them were kept
    forward_mode: ForwardMode  # the ForwardBatch's mode (equals `mode`; both shown, as the seed's order checks)
    batch_size: int
    num_tokens: int  # query tokens of the forward (len(input_ids))
    num_prefill_tokens: int  # of those, prompt tokens computed (EXTEND / PREFILL, MIXED's extend part)
    schedule_s: float  # picking the batch (PrefillAdder, prefix matches, slot allocation)
    build_s: float  # ModelWorkerBatch -> ForwardBatch (ForwardBatch.init_new)
    forward_s: float
    sample_s: float
    expert_load: dict[int, list[int]] | None = None  # MoE: tokens per expert of each sparse layer (layers/moe/)

    @classmethod
    def capture(cls, step: int, batch: ScheduleBatch, result: GenerationBatchResult, queue: QueueState,
                timing: tuple[float, float, float, float],
                expert_load: dict[int, list[int]] | None = None) -> StepRecord:
        """`queue`: the scheduler's queues and pool after this step's admission; `expert_load`: this step's
        tokens per expert (ExpertLoad.take(), MoE models only)."""
        fb = result.forward_batch
        mode = batch.forward_mode
        num_tokens = fb.input_ids.shape[0]
        spec_drafts = spec_accepted = None
        # NOTE: identity tests on the enum members, not is_*() calls: this runs every step.
        if mode is ForwardMode.DECODE:
            num_prefill = 0
        elif mode is ForwardMode.TARGET_VERIFY:
            num_prefill = 0
            spec_drafts = [list(r.spec_draft.tokens) for r in batch.reqs]
            spec_accepted = result.sample_output.accept_lens
        elif mode is ForwardMode.MIXED:  # the extend requests come first (ScheduleBatch.num_extend_reqs)
            k = batch.num_extend_reqs
            num_prefill = sum(batch.seq_lens[:k]) - sum(batch.prefix_lens[:k])
        else:
            num_prefill = num_tokens
        waiting = queue.num_waiting_reqs
        return cls(  # positional: half the cost of keywords for 23 fields
            step, time.time(), mode, [r.rid for r in batch.reqs], batch.prefix_lens[:], batch.seq_lens[:],
            queue.chunked_rid, waiting, queue.num_running_reqs, queue.wait_reason if waiting else None,
            queue.kv_available, queue.kv_cached, queue.new_token_ratio, spec_drafts, spec_accepted,
            fb.forward_mode, fb.batch_size, num_tokens, num_prefill, *timing, expert_load,
        )

    def to_json(self) -> dict[str, Any]:
        """The record as the trace file and the HTTP endpoints carry it."""
        out = self._to_json()
        if self.expert_load is not None:
            out["moe"] = {"expert_load": {str(layer): c for layer, c in self.expert_load.items()}}
        return out

    def _to_json(self) -> dict[str, Any]:
        positions = [min(self.prefix_lens), max(self.seq_lens) - 1] if self.seq_lens else None
        return {
            "step": self.step,
            "time": self.time,
            "schedule": {
                "mode": self.mode.name,
                "rids": self.rids,
                "prefix_lens": self.prefix_lens,
                "extend_lens": [s - p for s, p in zip(self.seq_lens, self.prefix_lens)],
                "chunked_rid": self.chunked_rid,
                "num_waiting": self.num_waiting,
                "num_running": self.num_running,
                "wait_reason": self.wait_reason,
                "kv_available": self.kv_available,
                "kv_cached": self.kv_cached,
                "new_token_ratio": round(self.new_token_ratio, 4),
                # TARGET_VERIFY: each request's drafts and how many of them the rejection rule kept (a
                # request produced accepted + 1 tokens, fewer if a stop rule ended it inside the run)
                "spec_drafts": self.spec_drafts,
                "spec_accept_lens": self.spec_accept_lens,
            },
            "forward": {
                "forward_mode": self.forward_mode.name,
                "batch_size": self.batch_size,
                "num_tokens": self.num_tokens,
                "num_prefill_tokens": self.num_prefill_tokens,
                "positions_range": positions,  # [first, last] position any request computes this step
            },
            "timing": {
                "schedule_ms": round(self.schedule_s * 1e3, 3),
                "build_ms": round(self.build_s * 1e3, 3),
                "forward_ms": round(self.forward_s * 1e3, 3),
                "sample_ms": round(self.sample_s * 1e3, 3),
            },
        }


class BatchTracer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "a", buffering=1)  # noqa: SIM115  # line-buffered, kept open: a crash keeps every step

    def record(self, rec: StepRecord, result: GenerationBatchResult) -> None:
        fb = result.forward_batch
        line = rec.to_json()
        line["forward"].update({
            "input_ids": fb.input_ids.tolist(),
            "positions": fb.positions.tolist(),
            "seq_lens": fb.seq_lens_cpu,
            "req_pool_indices": fb.req_pool_indices.tolist(),
            "out_cache_loc": fb.out_cache_loc.tolist(),
            "extend_prefix_lens": fb.extend_prefix_lens_cpu,
            "extend_seq_lens": fb.extend_seq_lens_cpu,
        })
        line["result"] = {"next_token_ids": result.sample_output.next_token_ids.tolist()}
        self.file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.file.close()
