"""The scheduler's half of speculative decoding (the worker's half is speculative/spec_worker.py).

    _prepare_verify()        instead of a DECODE step: ask the worker for drafts; if there are any
                             and the pool has a slot for every verified position, the running batch
                             becomes a TARGET_VERIFY step (ScheduleBatch.prepare_for_verify)
    _process_verify_one()    after it: accept per request, append the produced tokens one by one with
                             the stop checks (EOS, stop strings, max_new_tokens, context) between them,
                             then free the slots past the verified tokens (ScheduleBatch.release_rejected)

Only verified tokens ever reach the KV a request keeps and the radix cache: a request that finishes
inside an accepted run drops the rest, and its kv_len is what it verified. A failing verify forward
is bisected like any other step (the drafts live on each Req, so a half-batch re-runs the same
positions), and the failed request's slots (all L positions) are released by _fail.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from radixserve.managers.schedule_batch import OutOfKVSlots

if TYPE_CHECKING:
    from radixserve.managers.req import Req
    from radixserve.managers.schedule_batch import ScheduleBatch


class SchedulerSpecMixin:
    def _prepare_verify(self) -> bool:
        """Turn the running batch into a TARGET_VERIFY step; False = run plain DECODE."""
        worker = self.spec_worker
        if worker is None:
            return False
        batch = self.running_batch
        drafts = worker.propose(batch.reqs)
        if drafts is None:
            return False
        need = batch.verify_slots_needed(drafts)
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        if self.allocator.available_size() < need:
            return False  # drafts are optional: never retract for them
        try:
            batch.prepare_for_verify(drafts)
        except OutOfKVSlots:
            return False
        return True

    def _process_verify_one(self, batch: ScheduleBatch, i: int, req: Req, next_ids: list[int]) -> None:
        alloc_len = batch.seq_lens[i]
        width = alloc_len - batch.prefix_lens[i]
        req.kv_len = alloc_len
        if req.finished():
            return  # aborted while this step ran (its slots went with it)
        targets = next_ids[i * width : (i + 1) * width]
        produced = self.spec_worker.accept(req, targets, req.spec_draft)
        reason = None
        for tok in produced:
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            self.stats["generation_tokens"] += 1
            reason = self.output_processor.check_finished(req, self.model_config.context_len)
            if reason is not None:
                break
        batch.release_rejected(req, alloc_len)
        req.spec_draft = []
        if reason is not None:
            self._finish(req, reason)
        else:
            self.output_processor.maybe_stream(req)
