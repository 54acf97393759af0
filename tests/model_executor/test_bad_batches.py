"""Bad batches fail loudly, naming the problem, and leave the pools as they were."""

from __future__ import annotations

import pytest
import torch

from radixserve.exceptions import OutOfKVSlots
from radixserve.managers.req import Req
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from tests.model_executor.hand_batch import GREEDY


def test_inconsistent_batch_is_rejected(model_runner):
    mwb = ModelWorkerBatch(ForwardMode.PREFILL, [1, 2, 3], [0], [3], [0], torch.tensor([5, 6]), [GREEDY])
    with pytest.raises(ValueError, match="out_cache_loc"):
        ForwardBatch.init_new(mwb, model_runner)


def test_sequence_longer_than_context_is_rejected(model_runner):
    pool = model_runner.req_to_token_pool
    row = pool.alloc()
    try:
        with pytest.raises(ValueError, match="context length"):
            pool.write(row, 0, torch.ones(pool.max_context_len + 1, dtype=torch.int64))
    finally:
        pool.free(row)


def test_batch_needing_more_kv_slots_than_exist(make_runner):
    runner = make_runner(max_total_tokens=64)
    alloc = runner.token_to_kv_pool_allocator
    before = alloc.available_size()
    assert alloc.alloc(before + 1) is None and alloc.available_size() == before  # all or nothing
    cache = ChunkCache(runner.req_to_token_pool, alloc, 1)
    req = Req("big", list(range(100)), GREEDY)
    req.init_next_round_input()
    batch = ScheduleBatch([req], runner.req_to_token_pool, alloc, cache)
    with pytest.raises(OutOfKVSlots, match="no KV slots for 100 tokens"):
        batch.prepare_for_extend()
    assert alloc.available_size() == before
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
