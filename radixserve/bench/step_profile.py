"""Where the time of one forward step goes: torch.profiler over a step, top operators by self time.

    profile_step(fn, top=15) -> {"wall_ms", "ops_self_ms", "top": [{"name", "calls", "self_ms", "pct"}]}

`wall_ms - ops_self_ms` is time spent outside torch operators: Python, ForwardBatch building,
the attention backend's metadata, the sampler's host code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def profile_step(fn: Callable[[], Any], top: int = 15, warmup: int = 1) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    rows = [
        {"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in events
        if e.self_cpu_time_total > 0
    ]
    total = sum(r["self_ms"] for r in rows)
    rows.sort(key=lambda r: -r["self_ms"])
    for r in rows:
        r["pct"] = 100.0 * r["self_ms"] / total if total else 0.0
    return {"wall_ms": wall * 1e3, "ops_self_ms": total, "top": rows[:top]}

