"""ChunkCache (--disable-radix-cache): no sharing, everything a request holds is freed on finish.
Its full request lifecycles run in test_radix_cache.py::test_request_lifecycles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool


@dataclass
class Req:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def make(ps: int) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, ChunkCache]:
    pool = ReqToTokenPool(size=2, max_context_len=32)
    alloc = TokenToKVPoolAllocator(16 * ps, page_size=ps)
    return pool, alloc, ChunkCache(pool, alloc, ps)


def admit(pool: ReqToTokenPool, alloc: TokenToKVPoolAllocator, cache: ChunkCache, prompt: list[int]) -> Req:
    req = Req(prompt)
    prefix, node = cache.match_prefix(prompt[:-1])
    assert prefix.numel() == 0 and prefix.dtype == torch.int64 and node is cache.root
    cache.inc_lock_ref(node)
    row = pool.alloc()
    assert row is not None
    req.req_pool_idx, req.prefix_indices, req.last_node = row, prefix, node
    return req


def test_nothing_is_ever_cached() -> None:
    _, alloc, cache = make(1)
    slots = alloc.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.evict(100) == 0 and cache.all_slots().numel() == 0
    cache.reset()
    assert alloc.available_size() == alloc.total_size - 3  # the caller still owns its slots


@pytest.mark.parametrize("ps", [1, 4])
def test_chunked_prefill_then_finish_frees_everything(ps: int) -> None:
    pool, alloc, cache = make(ps)
    prompt = list(range(10))
    req = admit(pool, alloc, cache, prompt)
    row = req.req_pool_idx
    first = alloc.alloc_extend([0], [6], [0])
    assert first is not None
    pool.write(row, 0, first)
    req.fill_ids = prompt[:6]
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == first.tolist() and req.last_node is cache.root
    rest = alloc.alloc_extend([6], [10], [int(first[-1])])
    assert rest is not None
    pool.write(row, 6, rest)
    req.output_ids = [42]  # sampled; no KV yet, so kv_len == 10
    held = pool.req_to_token[row, :10].clone()
    cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.total_size and pool.available_size() == pool.size
    assert req.prefix_indices.tolist() == first.tolist(), "prefix_indices must not alias the row"
    assert not set(held.tolist()) - alloc.free_slot_set()


def test_abort_mid_prefill_with_explicit_kv_len() -> None:
    pool, alloc, cache = make(4)
    req = admit(pool, alloc, cache, list(range(12)))
    slots = alloc.alloc(5)
    assert slots is not None
    pool.write(req.req_pool_idx, 0, slots)
    req.fill_ids = req.origin_input_ids[:5]
    cache.cache_finished_req(req, kv_len=5)
    assert alloc.available_size() == alloc.total_size and pool.available_size() == pool.size


def test_page_size_must_match_allocator() -> None:
    pool = ReqToTokenPool(size=1, max_context_len=8)
    with pytest.raises(ValueError):
        ChunkCache(pool, TokenToKVPoolAllocator(32, page_size=4), 1)
