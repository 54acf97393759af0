"""ChunkCache: the prefix cache for --disable-radix-cache. Nothing is shared or kept.

Every slot a request holds stays request-owned until cache_finished_req frees it; the cache
itself never holds a slot, so all sizes are 0 and evict() frees nothing. The name comes from
its one remaining job: remembering a chunked prefill's computed part between chunks (in
req.prefix_indices) so the next chunk extends it instead of recomputing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import ReqToTokenPool


class _DummyRoot:
    """Stands in for a tree node: lock/unlock on it are no-ops."""

    def __repr__(self) -> str:
        return "ChunkCache.root"


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        self.root = _DummyRoot()

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty(), self.root)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        # Nothing is stored, so nothing was already present: the caller keeps all of value.
        return 0

    def cache_finished_req(self, req: CacheReq, kv_len: int | None = None) -> None:
        if kv_len is None:
            kv_len = len(req.origin_input_ids) + len(req.output_ids) - 1
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len]
        self.token_to_kv_pool_allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        # clone: the row is zeroed when it is freed, a view would silently change.
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)]
        req.prefix_indices = row.clone()
        req.last_node = self.root

    def tree_owned_len(self, req: CacheReq) -> int:
        return 0  # nothing is shared: every slot in a row belongs to its request

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return self._empty()

    def reset(self) -> None:
        pass
