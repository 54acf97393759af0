"""The prefix-cache interface the scheduler talks to (RadixCache, or ChunkCache when sharing is off).

Ownership model (every KV slot the allocator has handed out has exactly one owner):

    allocator free list  |  tree nodes (this cache)  |  live requests (slots in their row that the
                         |                           |  tree does not own: the computed suffix)

    allocator.available_size() + cache.total_size() + sum(request-owned) == allocator.total_size

A request's row in req_to_token looks like this while it runs (page_size p = 4 here):

    position   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
               +------- tree-owned --------+   +- request-owned (newly computed, or a
               (prefix_indices, locked via        partial page: trees hold whole pages)
                req.last_node)

Slots are moved from a request into the tree only by cache_finished_req / cache_unfinished_req;
whatever part the tree already had is freed there, so a slot never has two owners.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from radixserve.mem_cache.allocator import round_down_to_page
from radixserve.mem_cache.request_slots import RequestSlots

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import ReqToTokenPool


class CacheReq(Protocol):
    """The only request fields a prefix cache reads or writes (the scheduler's Req has more)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int
    prefix_indices: torch.Tensor
    last_node: Any
    swa_freed_len: int  # positions below it freed their sliding-window KV (release_outside_window)


class MatchResult(NamedTuple):
    """device_indices: int64 KV slots of the matched prefix; len is a multiple of page_size.
    last_node: the deepest matched node, to pass to inc_lock_ref (the root when nothing matched)."""

    device_indices: torch.Tensor
    last_node: Any


class BasePrefixCache(ABC):
    """A cache of KV slots keyed by token-id prefixes.

    Invariants callers rely on:
    - Slots returned by match_prefix stay valid only while their last_node is locked
      (inc_lock_ref); an unlocked node may be evicted and its slots reused by the allocator.
    - Keys and values in the cache are whole pages: every stored key length is a multiple of
      page_size, and token i of a key sits in a slot with slot % page_size == i % page_size.
    - evictable_size() + protected_size() == total_size() == all_slots().numel(), always.
    - protected_size() counts slots in nodes with lock_ref > 0; evict() never touches them.
    - insert() never evicts and never frees: the caller frees the duplicate slots it reports.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError(
                f"page_size {page_size} != allocator page_size {token_to_kv_pool_allocator.page_size}"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = token_to_kv_pool_allocator.device

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of key, truncated to whole pages. Touches LRU times on the path.
        Does not lock: the caller locks last_node before anything can evict."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Store value[i] as the slot of key[:i+1]; len(key) must be a multiple of page_size.

        Returns how many leading tokens of key were already cached. The tree keeps its own slots
        for those, so value[:returned] is NOT taken: the caller still owns those slots and must
        free the ones it did not get from the tree. value[returned:] now belongs to the tree."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq, kv_len: int | None = None) -> None:
        """Hand a finished (or aborted) request's KV to the cache and release its row and lock.

        kv_len defaults to len(origin_input_ids) + len(output_ids) - 1 (the newest sampled token
        has no KV). Requirement: row[:kv_len] holds computed KV, the row holds no slot beyond
        kv_len, and kv_len >= len(req.prefix_indices). After the call every slot of the row is
        either in the tree or free, the row is free, and req.last_node is unlocked."""

    def release_req(self, req: CacheReq, alloc_len: int) -> None:
        """Drop a request whose KV cannot be trusted (its step failed): free every slot its row
        owns up to alloc_len (what the scheduler allocated for it), unlock its prefix and free the
        row, inserting nothing into the cache. The tree keeps the prefix it already owned."""
        RequestSlots(self.req_to_token_pool, self.token_to_kv_pool_allocator).free_row(
            req.req_pool_idx, self.tree_owned_len(req), alloc_len)
        self.dec_lock_ref(req.last_node)

    def release_outside_window(self, reqs: list, first_new: list[int]) -> None:
        """A hybrid sliding-window pool (swa_memory_pool.py): before a step computes positions >= first_new[i]
        of reqs[i], free the local KV of the request-owned positions no query of it will see again (a query at
        p sees p - window < j <= p). The tree's nodes are the tree's to tombstone (swa_radix_cache.py)."""
        window = getattr(self.token_to_kv_pool_allocator, "swa_window", None)
        if window is None:
            return
        rtt = self.req_to_token_pool.req_to_token
        gone = []  # one free_swa for the whole batch: at decode each request gives back about one slot a step
        for req, p in zip(reqs, first_new):
            lo, hi = max(req.swa_freed_len, self.tree_owned_len(req)), p - window
            if hi > lo:
                gone.append(rtt[req.req_pool_idx, lo:hi])
                req.swa_freed_len = hi
        if gone:
            self.token_to_kv_pool_allocator.free_swa(torch.cat(gone))

    def swa_evictable_size(self) -> int:
        """Sliding-window slots the cache could free (a hybrid pool's; none here)."""
        return 0

    def tree_owned_len(self, req: CacheReq) -> int:
        """How many leading slots of the request's row the cache owns (whole pages of its prefix)."""
        return round_down_to_page(len(req.prefix_indices), self.page_size)

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """After a prefill chunk: cache the whole pages of req.fill_ids, point the row at the
        tree's slots, move the lock to the new last node, and set req.prefix_indices /
        req.last_node. The unaligned tail stays owned by the request (end of prefix_indices)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect node and its ancestors from eviction (counted; the root is a no-op)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref(node)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, least recently used first (fewer
        if not enough is evictable). Returns the number of slots freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots in nodes with lock_ref == 0."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots in nodes with lock_ref > 0."""

    @abstractmethod
    def total_size(self) -> int:
        """Slots held by the cache."""

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every slot held by the cache (int64, any order), for invariant checks."""

    def eviction_epoch(self) -> int:
        """Changes whenever match_prefix may have evicted (the disk tier's restores): matches taken before are
        stale. Constant here: a plain match never evicts."""
        return 0

    def memory_only(self) -> contextlib.AbstractContextManager:
        """Within it, match_prefix does not restore from a lower tier (so it cannot evict)."""
        return contextlib.nullcontext()

    def on_prefix_hit(self, node: Any) -> None:
        """An admitted request reuses the cached prefix ending at `node` (the disk tier counts hits)."""

    def info(self) -> dict[str, Any]:
        """Sections of get_server_info() about this cache's tiers ("hicache": the disk tier's, "swa": the
        sliding-window pool's); none here."""
        return {}

    def reset_storage(self) -> None:
        """Empty the disk tier (callers check that one exists: TokenizerManager.flush_cache)."""

    def close(self) -> None:
        """The scheduler is stopping (the disk tier saves what it can)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, returning all cached slots to the allocator (flush_cache). Only legal
        while nothing is locked. Do not clear() the allocator first: that would double-free."""
