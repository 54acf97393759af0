"""StepLog: the scheduler's last STEP_LOG_SIZE step records, in memory.

    Scheduler.run_batch --record(QueueState, ...)--> StepLog ring (bounded deque, always on)
                                                       |  read only when asked, between steps:
    GetServerInfoReq(steps_since=S) ---------------->  snapshot(): records after step S (+ a few counts)

The record is the one --trace-batches writes (debug/trace.py), so the web dashboard's pipeline view
and the trace file never disagree. Per step the ring costs one StepRecord (copies of the batch's
small lists, a few numbers: a few microseconds); turning records into JSON happens only in
snapshot(), i.e. when a dashboard or the /debug/steps endpoint asks, at most a few times a second.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from radixserve.debug.trace import StepRecord

if TYPE_CHECKING:
    from radixserve.layers.moe.expert_load import ExpertLoad
    from radixserve.managers.queue_state import QueueState
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.model_executor.results import GenerationBatchResult

STEP_LOG_SIZE = 512  # records kept: a few seconds of steps on a GPU, a minute or more on a CPU
MAX_STEPS_PER_SNAPSHOT = 512  # what one answer may carry (= the ring: a snapshot never grows past it)


class StepLog:
    def __init__(self, capacity: int = STEP_LOG_SIZE) -> None:
        self.ring: deque[StepRecord] = deque(maxlen=capacity)
        self.schedule_s = 0.0  # set by Scheduler.step(): time spent picking the batch of this step
        self._prev_timers = (0.0, 0.0, 0.0)
        self.num_prefill_tokens = 0  # prompt tokens computed by every step so far (input tokens/s)

    def record(self, step: int, batch: ScheduleBatch, result: GenerationBatchResult, queue: QueueState,
               timers: Mapping[str, float], expert_load: ExpertLoad | None) -> StepRecord:
        """`timers`: the ModelRunner's cumulative ones (this step's share is the difference since the last
        record); `expert_load`: the model's MoE accumulator (None for a dense model), taken once per step."""
        build, forward, sample = timers["forward_batch_init_s"], timers["forward_s"], timers["sample_s"]
        b0, f0, s0 = self._prev_timers
        self._prev_timers = (build, forward, sample)
        rec = StepRecord.capture(step, batch, result, queue, (self.schedule_s, build - b0, forward - f0, sample - s0),
                                 None if expert_load is None else expert_load.take())
        self.ring.append(rec)
        self.num_prefill_tokens += rec.num_prefill_tokens
        return rec

    def snapshot(self, since: int, rid: str | None, limit: int, num_evictable_tokens: int,
                 num_retracted_waiting_reqs: int) -> dict[str, Any]:
        """Records with step > since (the newest `limit` of them; only those holding `rid` if given),
        oldest first, plus the counts the dashboard shows beside get_server_info() (the last two arguments,
        the scheduler's: Scheduler.get_steps)."""
        limit = max(0, min(limit, MAX_STEPS_PER_SNAPSHOT))
        picked: list[StepRecord] = []
        for rec in reversed(self.ring):  # newest first: stop as soon as enough (or too old)
            if rec.step <= since or len(picked) >= limit:
                break
            if rid is None or rid in rec.rids:
                picked.append(rec)
        picked.reverse()
        return {
            "steps": [r.to_json() for r in picked],
            "last_step": self.ring[-1].step if self.ring else -1,
            "oldest_step": self.ring[0].step if self.ring else -1,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_evictable_tokens": num_evictable_tokens,
            "num_retracted_waiting_reqs": num_retracted_waiting_reqs,
            "scheduler_time": time.time(),
        }
