"""--trace-batches FILE: one JSON line per step, in the seed's debugging order:

    1. "schedule": what the ScheduleBatch selected and why (rids, prefix/extend lengths, queue sizes)
    2. "forward":  what the ForwardBatch carried (mode, input_ids, positions, seq_lens, out_cache_loc, ...)
    3. "result":   what the ModelRunner produced (sampled ids)

`radixserve inspect FILE` reads it back (debug/inspect.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import GenerationBatchResult


class BatchTracer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "a", buffering=1)  # line-buffered: a crash keeps every finished step

    def record(self, step: int, batch: ScheduleBatch, result: GenerationBatchResult, sched: Scheduler) -> None:
        fb = result.forward_batch
        line: dict[str, Any] = {
            "step": step,
            "schedule": {
                "mode": batch.forward_mode.name,
                "rids": [r.rid for r in batch.reqs],
                "prefix_lens": batch.prefix_lens,
                "extend_lens": [s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)],
                "chunked_rid": sched.chunked_req.rid if sched.chunked_req else None,
                "num_waiting": len(sched.waiting_queue),
                "num_running": len(sched.running_batch.reqs),
                "kv_available": sched.allocator.available_size(),
                "kv_cached": sched.tree_cache.total_size(),
                "new_token_ratio": round(sched.new_token_ratio, 4),
                # TARGET_VERIFY: each request's drafts (what was accepted shows in the next step's prefix_lens)
                "spec_drafts": [r.spec_draft for r in batch.reqs] if batch.forward_mode.is_target_verify() else None,
            },
            "forward": {
                "forward_mode": fb.forward_mode.name,
                "batch_size": fb.batch_size,
                "input_ids": fb.input_ids.tolist(),
                "positions": fb.positions.tolist(),
                "seq_lens": fb.seq_lens_cpu,
                "req_pool_indices": fb.req_pool_indices.tolist(),
                "out_cache_loc": fb.out_cache_loc.tolist(),
                "extend_prefix_lens": fb.extend_prefix_lens_cpu,
                "extend_seq_lens": fb.extend_seq_lens_cpu,
            },
            "result": {"next_token_ids": result.sample_output.next_token_ids.tolist()},
        }
        self.file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.file.close()
