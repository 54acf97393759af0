"""The scheduler's state as /get_server_info, /metrics and the web dashboard report it: one snapshot,
built on request (never per step); with data parallel, the replicas' snapshots merged into one."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.layers.moe.expert_load import ExpertLoad
    from radixserve.managers.queue_state import QueueState


def server_info(queue: QueueState, stats: Mapping[str, int], *, grammar: Mapping[str, Any],
                spec: Mapping[str, float], expert_load: ExpertLoad | None, failed_forward_streak: int,
                deterministic_inference: bool, generation_tokens: int, context_len: int, step_time_s: float,
                forward_timers: Mapping[str, float], cache_tiers: Mapping[str, Any] | None = None,
                native_decode_steps: int = 0) -> dict[str, Any]:
    """One replica's snapshot, from what Scheduler.get_server_info() hands over: the queues and pool
    (`queue`), the scheduler's counters (`stats`), each component's own report (`grammar`: GrammarQueue.info(),
    `spec`: SpecWorker.info(), the MoE accumulator) and the ModelRunner's cumulative `forward_timers`."""
    cached = queue.kv_cached
    total = queue.kv_total
    return {
        "max_total_num_tokens": total,
        "num_used_tokens": total - queue.kv_available - cached,
        "num_cached_tokens": cached,
        "num_running_reqs": queue.num_running_reqs + (1 if queue.chunked_rid is not None else 0),
        "num_waiting_reqs": queue.num_waiting_reqs,
        **grammar,
        "cache_hit_rate": stats["cached_tokens"] / max(1, stats["prompt_tokens"]),
        "cached_tokens": stats["cached_tokens"],
        "num_retractions": stats["num_retractions"],
        "num_failed_reqs": stats["num_failed_reqs"],
        "num_timed_out_reqs": stats["num_timed_out_reqs"],
        "failed_forward_streak": failed_forward_streak,
        "deterministic_inference": deterministic_inference,
        "generation_tokens": generation_tokens,
        # decode / verify steps the native decode stack ran whole (model_executor/cpu_graph_runner.py)
        "native_decode_steps": native_decode_steps,
        **spec,
        **({} if expert_load is None else expert_load.info()),
        "prompt_tokens": stats["prompt_tokens"],
        "context_len": context_len,
        # "hicache" (--enable-hierarchical-cache): each tier's tokens / bytes, hits from disk, evictions; "swa" (a
        # hybrid sliding-window pool): each pool's tokens, free and tombstoned local KV (the tree cache's info())
        **dict(cache_tiers or {}),
        # Where the scheduler's time went (cumulative seconds since start): `step_time_s` is
        # every step; the model forward alone is `forward_s`, so step_time_s - forward_s is the
        # scheduling, batch building, sampling and output processing around it.
        "time_split": {
            "step_time_s": step_time_s, **forward_timers,
            "scheduler_process_cpu_s": time.process_time(),
        },
    }


# Merged by a rule other than the sum (the rest of the numbers, nested ones too, add up over replicas).
_SAME = ("context_len", "deterministic_inference")  # a property of the configuration: replica 0's
_MAX = ("failed_forward_streak", "last_step", "scheduler_time")
_MIN = ("oldest_step",)
# What each replica's entry of "dp" shows (besides the router's counts, added by the caller).
DP_KEYS = ("num_running_reqs", "num_waiting_reqs", "cache_hit_rate", "cached_tokens", "prompt_tokens",
           "generation_tokens", "max_total_num_tokens", "num_used_tokens", "num_cached_tokens", "num_failed_reqs",
           "num_timed_out_reqs", "num_retractions", "failed_forward_streak", "spec_accept_length",
           "moe_expert_tokens", "hicache", "swa", "mm_encoder_cache")


def _sum(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {k: _sum([v[k] for v in values if k in v]) for k in values[0]}
    if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
        return sum(values)
    return values[0]


def merge_replica_infos(parts: list[dict[str, Any]], steps_limit: int = 64) -> dict[str, Any]:
    """One server-wide snapshot from each replica's (each has "dp_rank" and the router's counts):
    counters and pool sizes add up, the hit rate and the speculative accept length are recomputed from
    the summed counts, the step records are merged in time order (each tagged with its dp_rank, the
    newest steps_limit kept; "dp_last_step" is every replica's cursor for the next poll), and "dp"
    lists each replica's own figures. With one replica the numbers are that replica's."""
    out: dict[str, Any] = {}
    for key in parts[0]:
        values = [p[key] for p in parts if key in p]
        if key in _SAME:
            out[key] = values[0]
        elif key in _MAX:
            out[key] = max(values)
        elif key in _MIN:
            out[key] = min(values)
        elif key != "steps":
            out[key] = _sum(values)
    out["cache_hit_rate"] = out.get("cached_tokens", 0) / max(1, out.get("prompt_tokens", 0))
    verify_ct = out.get("spec_verify_ct", 0)
    if verify_ct:
        out["spec_accept_length"] = sum(p["spec_accept_length"] * p["spec_verify_ct"] for p in parts) / verify_ct
    if "steps" in parts[0]:
        steps = [{**rec, "dp_rank": p["dp_rank"]} for p in parts for rec in p["steps"]]
        if len(parts) > 1:
            steps.sort(key=lambda rec: rec["time"])
        out["steps"] = steps[-steps_limit:] if steps_limit > 0 else []
        out["dp_last_step"] = [p["last_step"] for p in parts]
        out["num_steps"] = sum(p["last_step"] + 1 for p in parts)
    out["dp"] = [{"dp_rank": p["dp_rank"], **{k: p[k] for k in DP_KEYS if k in p},
                  **{k: p[k] for k in ("num_routed_reqs", "num_in_flight_reqs", "num_served_reqs",
                                       "prefix_index_tokens") if k in p}} for p in parts]
    for key in ("dp_rank", "num_routed_reqs", "num_served_reqs", "prefix_index_tokens"):
        out.pop(key, None)  # per replica only
    return out
