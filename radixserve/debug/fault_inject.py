"""A test hook: a batch holding a request whose rid contains RADIXSERVE_FAULT_INJECT's value raises inside
Scheduler.run_batch, as a model bug triggered by one request would (tests/entrypoints/test_http_faults.py,
tests/managers/test_isolation.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable

FAULT_INJECT_ENV = "RADIXSERVE_FAULT_INJECT"


def fault_marker_from_env() -> str | None:
    return os.environ.get(FAULT_INJECT_ENV) or None


def raise_injected_fault(marker: str | None, rids: Iterable[str]) -> None:
    if marker is not None:
        hit = next((rid for rid in rids if marker in rid), None)
        if hit is not None:
            raise RuntimeError(f"injected fault ({FAULT_INJECT_ENV}) in a batch holding {hit}")
