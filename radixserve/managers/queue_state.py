"""QueueState: the scheduler's queues and KV pool at one moment, as plain values.

The scheduler builds one (Scheduler.queue_state()) for each step record (debug/trace.py) and for each
get_server_info() answer (managers/server_info.py), so neither reads the live Scheduler, its queues or its
Reqs: they get numbers, and the scheduler stays free to change its state after handing them over."""

from __future__ import annotations

from typing import NamedTuple


class QueueState(NamedTuple):
    num_waiting_reqs: int
    num_running_reqs: int  # the running (decoding) batch; the chunked request is not in it
    chunked_rid: str | None  # the request whose prompt runs in chunks (Scheduler.chunked_req), if any
    wait_reason: str | None  # why the waiting requests were not admitted by the last admission (PrefillAdder)
    kv_total: int  # the KV pool's slots (allocator.total_size)
    kv_available: int  # free slots
    kv_cached: int  # slots the radix tree holds
    new_token_ratio: float  # the decode reservation the admission budgets use
