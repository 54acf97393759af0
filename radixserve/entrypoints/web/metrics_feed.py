"""MetricsFeed: one poller of the scheduler shared by every connected dashboard.

    dashboard 1 --SSE--\\
    dashboard 2 --SSE---+-- MetricsFeed.render(n_steps)  <-- latest snapshot (JSON built once per poll)
    dashboard k --SSE--/            ^
                                    | every POLL_INTERVAL_S, only while >= 1 stream is open
                    tm.get_server_info(steps_since=last seen step)   (GetServerInfoReq -> the scheduler)

With --dp-size N the snapshot is the replicas' merged one: the cursor is one last-seen step per replica
("dp_last_step"), the step records come in time order tagged with their dp_rank, and "dp" in
server_info lists each replica's own counters.

The snapshot is get_server_info() -- the counters /get_server_info and /metrics report -- plus the
StepLog records the scheduler made since the previous poll (the --trace-batches record). So the
scheduler answers at most 1 / POLL_INTERVAL_S calls a second however many dashboards are open, and
each answer carries only the steps that are new; per client the feed only joins cached JSON strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25  # the feed's own rate: 4 snapshots a second at most, for all dashboards together
STEP_HISTORY = 64  # step records kept here for the dashboards (each stream asks for the newest N <= this)
STEPS_PER_POLL = 512  # the most one poll fetches (the scheduler's ring): at 4 polls/s, 2,048 steps/s
MAX_STREAMS = 32  # open metric streams at once; more is a 429 (a tab left open per user is the use case)
RATE_WINDOW_S = 1.0  # tokens/s are averaged over the last second: a one-step prefill burst shows in several snapshots

_INFO_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_retractions", "num_retracted_waiting_reqs",
              "num_in_flight_reqs", "num_failed_reqs", "num_timed_out_reqs", "max_total_num_tokens",
              "num_used_tokens", "num_cached_tokens", "num_evictable_tokens", "cache_hit_rate",
              "prompt_tokens", "generation_tokens", "num_prefill_tokens", "spec_accept_length", "dp")


class MetricsFeed:
    def __init__(self, server_info: Callable[..., Any], poll_interval_s: float = POLL_INTERVAL_S) -> None:
        """server_info: TokenizerManager.get_server_info (an async callable taking steps_since=...)."""
        self._server_info = server_info
        self.poll_interval_s = poll_interval_s
        self.num_streams = 0  # open SSE responses (the stream test checks it returns to 0)
        self.num_polls = 0  # scheduler calls made since start (the shared-rate test reads it)
        self.seq = 0  # snapshot number; 0 = none yet
        self._steps: deque[tuple[int, str]] = deque(maxlen=STEP_HISTORY)  # (step, its JSON text)
        self._last_step = -1  # the newest step number any replica reported
        self._since: int | list[int] = -1  # the cursor: the last step seen of each replica
        self._num_steps = 0  # steps run by all replicas together (steps/s)
        # (time, generation tokens, prefill tokens, steps run) of the polls in the last RATE_WINDOW_S
        self._samples: deque[tuple[float, int, int, int]] = deque()
        self._head = "{}"  # the latest snapshot without its steps, as JSON text
        self._rendered: dict[int, str] = {}  # n_steps -> SSE event text, for the current seq
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ streams
    def subscribe(self) -> None:
        self.num_streams += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def unsubscribe(self) -> None:
        self.num_streams = max(0, self.num_streams - 1)  # the poller notices and stops by itself

    async def wait_newer(self, seq: int, timeout_s: float) -> bool:
        """Wait until a snapshot newer than `seq` exists (True) or timeout_s passes (False)."""
        while self.seq <= seq:
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return self.seq > seq
        return True

    def render(self, n_steps: int) -> str:
        """The latest snapshot with its newest n_steps step records, as one SSE event."""
        text = self._rendered.get(n_steps)
        if text is None:
            steps = [s for _, s in list(self._steps)[-n_steps:]] if n_steps > 0 else []
            text = f'data: {self._head[:-1]}, "steps": [{", ".join(steps)}]}}\n\n'
            self._rendered[n_steps] = text
        return text

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ polling
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.num_streams > 0:
            started = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.poll_interval_s - (loop.time() - started)))

    async def poll_once(self) -> None:
        error: str | None = None
        info: dict[str, Any] = {}
        try:
            info = await self._server_info(steps_since=self._since, steps_limit=STEPS_PER_POLL)
        except Exception as e:  # noqa: BLE001  # a busy or dead scheduler: the dashboards show why
            error = f"{type(e).__name__}: {e}"
        self.num_polls += 1
        head = self._snapshot(info, error)
        self.seq += 1
        head["seq"] = self.seq
        self._head = json.dumps(head)
        self._rendered.clear()
        # Wake every waiting stream: set the old event, hand out a fresh one for the next snapshot.
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _snapshot(self, info: dict[str, Any], error: str | None) -> dict[str, Any]:
        now = time.perf_counter()
        steps = info.pop("steps", [])
        for rec in steps:
            self._steps.append((rec["step"], json.dumps(rec)))
        self._last_step = max(self._last_step, int(info.get("last_step", self._last_step)))
        self._since = info.get("dp_last_step", self._since)
        self._num_steps = int(info.get("num_steps", self._num_steps))
        head: dict[str, Any] = {"time": time.time(), "error": error, "num_streams": self.num_streams,
                                "poll_interval_s": self.poll_interval_s}
        if error is not None:
            return head
        head["server_info"] = {k: info[k] for k in _INFO_KEYS if k in info}
        head["time_split"] = info.get("time_split", {})
        head["last_step"] = self._last_step
        total, used, cached = (int(info.get(k, 0)) for k in ("max_total_num_tokens", "num_used_tokens",
                                                              "num_cached_tokens"))
        evictable = int(info.get("num_evictable_tokens", cached))
        # free + held by running requests (not in the tree) + in the tree == total (DESIGN section 4)
        head["kv"] = {"total": total, "free": total - used - cached, "running": used, "cached": cached,
                      "cached_locked": cached - evictable, "cached_evictable": evictable}
        gen, prefill = int(info.get("generation_tokens", 0)), int(info.get("num_prefill_tokens", 0))
        rates = {"input_tok_s": 0.0, "output_tok_s": 0.0, "steps_s": 0.0}
        # the oldest sample kept is the newest one at least RATE_WINDOW_S old (the window's base)
        while len(self._samples) > 1 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        if self._samples:
            t0, gen0, prefill0, step0 = self._samples[0]
            dt = max(1e-6, now - t0)
            # max(0, ...): a flush_cache may reset a counter; never show a negative rate
            rates = {"input_tok_s": max(0, prefill - prefill0) / dt, "output_tok_s": max(0, gen - gen0) / dt,
                     "steps_s": max(0, self._num_steps - step0) / dt}
        self._samples.append((now, gen, prefill, self._num_steps))
        head["rates"] = {k: round(v, 2) for k, v in rates.items()}
        return head
