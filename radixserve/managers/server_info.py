"""The scheduler's state as /get_server_info, /metrics and the web dashboard report it: one snapshot,
built on request (never per step)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from radixserve.speculative.spec_worker import SpecWorker

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler


def server_info(s: Scheduler) -> dict[str, Any]:
    cached = s.tree_cache.total_size()
    total = s.allocator.total_size
    return {
        "max_total_num_tokens": total,
        "num_used_tokens": total - s.allocator.available_size() - cached,
        "num_cached_tokens": cached,
        "num_running_reqs": len(s.running_batch.reqs) + (1 if s.chunked_req else 0),
        "num_waiting_reqs": len(s.waiting_queue),
        **s.grammar_queue.info(),
        "cache_hit_rate": s.stats["cached_tokens"] / max(1, s.stats["prompt_tokens"]),
        "num_retractions": s.stats["num_retractions"],
        "num_failed_reqs": s.stats["num_failed_reqs"],
        "num_timed_out_reqs": s.stats["num_timed_out_reqs"],
        "failed_forward_streak": s.failed_forward_streak,
        "deterministic_inference": s.model_runner.deterministic,
        "generation_tokens": s.stats["generation_tokens"],
        **SpecWorker.info(s.spec_worker),
        "prompt_tokens": s.stats["prompt_tokens"],
        "context_len": s.model_config.context_len,
        # Where the scheduler's time went (cumulative seconds since start): `step_time_s` is
        # every step; the model forward alone is `forward_s`, so step_time_s - forward_s is the
        # scheduling, batch building, sampling and output processing around it.
        "time_split": {
            "step_time_s": s.step_time_s, **s.model_runner.timers,
            "scheduler_process_cpu_s": time.process_time(),
        },
    }
