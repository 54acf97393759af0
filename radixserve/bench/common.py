"""Shared helpers of the benchmarks: timing, statistics, tables, JSON and the machine description.

Every benchmark prints a plain-text table (what a person reads) and can write the same numbers
as JSON (what a script or a test reads). Times are wall-clock `time.perf_counter()`; on a GPU
the timed function synchronises before the clock stops.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.kernels.cpu import loader


# ---------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, device: torch.device | str | None = None
) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def time_fn_min_duration(fn: Callable[[], Any], min_s: float = 0.2, max_iters: int = 1000) -> float:
    """Seconds per call, repeating `fn` until at least `min_s` has passed (for sub-ms kernels);
    the best of three such rounds, so a neighbour's burst of CPU use does not count."""
    fn()  # warm-up: allocation, thread pool spin-up
    best = math.inf
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s / 3 or n >= max_iters:
                break
        best = min(best, elapsed / n)
    return best


# ---------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / median / p99 / min / max of `values` times `scale` (e.g. 1000 for s -> ms)."""
    vals = [v * scale for v in values]
    if not vals:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0}
    return {
        "mean": statistics.fmean(vals),
        "median": statistics.median(vals),
        "p99": percentile(vals, 99),
        "min": min(vals),
        "max": max(vals),
    }


def parse_int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (argparse type for the size-list flags)."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_range(text: str) -> tuple[int, int]:
    """"32,128" or "32:128" or "64" -> an inclusive (lo, hi) range."""
    parts = [int(x) for x in text.replace(":", ",").split(",") if x.strip()]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 0:
        raise ValueError(f"bad range {text!r}: expected LO,HI with 0 <= LO <= HI")
    return parts[0], parts[1]


# ---------------------------------------------------------------------------- output
def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None, title: str | None = None) -> str:
    """A plain-text table; floats get 4 significant digits, large ones thousands separators."""
    if not rows:
        return f"{title}\n(no rows)" if title else "(no rows)"
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v) or math.isinf(v):
                return str(v)
            return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None, title: str | None = None) -> None:
    print(format_table(rows, columns, title), flush=True)


def print_kv(items: dict[str, Any], title: str | None = None) -> None:
    """Two aligned columns: name, value (for one-result summaries such as serving)."""
    rows = [{"metric": k, "value": v} for k, v in items.items()]
    print(format_table(rows, ["metric", "value"], title), flush=True)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        # strict JSON: inf / nan (e.g. --request-rate inf) become strings
        json.dump(_finite(data), f, indent=2, default=_json_default, allow_nan=False)
        f.write("\n")
    print(f"wrote {path}", flush=True)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on (goes into every JSON)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.device(device).type == "cpu":
        # which of the features that pick a code path this CPU has, and the kernel variant it gets
        flags = loader.cpu_info()[0]
        info["cpu_features"] = sorted(flags & {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                                               "amx_int8"})
        try:
            info["kernel_variant"] = loader.selected_isa()
        except ValueError as e:  # a bad RADIXSERVE_CPU_ISA: say so in the record rather than fail the bench
            info["kernel_variant"] = str(e)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    info["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return info
