"""FailureIsolation: run a step so that one request's failure fails that request alone.

A forward that raises is bisected: each half of the batch (same slots, same inputs; ScheduleBatch.split)
runs on its own, recursively, until the failure is pinned on single requests; the halves that succeed
are processed as usual. Nothing is retried on success, so the cost is paid only when something fails.
A request a failure was pinned on gets a 500 and its KV is dropped, not cached. Faults of the device or
the process itself (is_fatal) stop the server instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed

from radixserve.exceptions import FatalSchedulerError, InvariantError
from radixserve.managers.req import FinishReason

if TYPE_CHECKING:
    from radixserve.managers.output_processor import OutputProcessor
    from radixserve.managers.req import Req
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger(__name__)


# A collective that failed (a peer rank died, hung past --dist-timeout, or the network broke) is no
# request's fault, and bisecting would only repeat it (each try waiting for the timeout again).
_DIST_FAULTS = ("NCCL", "gloo", "closed by peer", "reset by peer", "Timed out waiting")


def is_fatal(e: BaseException) -> bool:
    if isinstance(e, (MemoryError, FatalSchedulerError, InvariantError)):  # a broken invariant is our bug
        return True
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    return "CUDA error" in text or "device-side assert" in text or any(m in text for m in _DIST_FAULTS)


class FailureIsolation:
    """Owns the failure streak; the scheduler hands it the step's two halves (forward, then processing the
    result) per call, and at construction only what a pinned failure touches: the tree, the outputs, the
    failure count."""

    def __init__(self, tree_cache: BasePrefixCache, output_processor: OutputProcessor, stats: dict[str, int]) -> None:
        self.tree_cache = tree_cache
        self.output_processor = output_processor
        self.stats = stats  # the scheduler's counters (num_failed_reqs)
        self.streak = 0  # forwards in a row that raised (reset by any success)

    def run(self, batch: ScheduleBatch, forward: Callable[[ScheduleBatch], Any],
            process: Callable[[ScheduleBatch, Any], None]) -> None:
        try:
            result = forward(batch)
        except Exception as e:
            if is_fatal(e):
                raise FatalSchedulerError(f"the model failed: {type(e).__name__}: {e}") from e
            self.streak += 1
            if batch.batch_size() == 1:
                req = batch.reqs[0]
                if not req.finished():
                    self.fail(req, batch.seq_lens[0], e, "while running this request")
                return
            logger.warning("a batch of %d failed (%s: %s); bisecting to find the request",
                           batch.batch_size(), type(e).__name__, e)
            for half in batch.split():
                self.run(half, forward, process)
            return
        self.streak = 0
        process(batch, result)

    def fail(self, req: Req, alloc_len: int, e: BaseException, where: str) -> None:
        """A request a failure was pinned on: a 500, its KV dropped (not cached); everything else goes on
        (a chunked request the failure was pinned on is dropped by the scheduler: it is finished)."""
        logger.error("request %s failed %s: %s: %s", req.rid, where, type(e).__name__, e, exc_info=e)
        self.stats["num_failed_reqs"] += 1
        if req.req_pool_idx is not None:
            self.tree_cache.release_req(req, alloc_len)
            req.req_pool_idx = None
        req.error = (500, f"internal error {where}: {type(e).__name__}: {e}")
        req.finished_reason = FinishReason("abort", message="internal error")
        self.output_processor.pending.append(req)
