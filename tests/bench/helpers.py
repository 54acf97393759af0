"""Checks shared by the benchmark tests."""

from __future__ import annotations

import json
import math
from typing import Any


def read_json(path: Any) -> dict[str, Any]:
    """Load a benchmark's JSON, refusing NaN / Infinity (strict JSON, readable by any tool)."""

    def reject(const: str) -> None:
        raise ValueError(f"non-standard JSON constant {const}")

    with open(path) as f:
        return json.load(f, parse_constant=reject)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def check_stats(stats: dict[str, float], positive: bool = True) -> None:
    """A summarize() dict: min <= median <= p99 <= max, min <= mean <= max."""
    assert set(stats) >= {"mean", "median", "p99", "min", "max"}
    assert stats["min"] <= stats["median"] <= stats["p99"] <= stats["max"] + 1e-9
    assert stats["min"] - 1e-9 <= stats["mean"] <= stats["max"] + 1e-9
    if positive:
        assert stats["min"] > 0


def check_throughputs(m: dict[str, Any], requests_key: str) -> None:
    """Every throughput is its token count over the same duration."""
    d = m["duration_s"]
    assert d > 0
    assert close(m["request_throughput"], m[requests_key] / d)
    assert close(m["input_throughput"], m["total_input_tokens"] / d)
    assert close(m["output_throughput"], m["total_output_tokens"] / d)
    assert close(m["total_throughput"], (m["total_input_tokens"] + m["total_output_tokens"]) / d)
