"""SWARadixCache: the radix tree over a hybrid pool (swa_memory_pool.py), SGLang's tombstones.

A node's KV slots always hold the full layers' KV. Its sliding-window KV may be gone: the node is then
a tombstone. A match may only end where the last `window` tokens before it are not tombstones (a local
layer's first query there reads them):

    root - [0..63] - [64..127] - [128..191] - [192..255]        window 100
           tomb      tomb        live          live
    match of 256 tokens: ends at 256 (the 128 tokens before it are live); of 192 tokens: ends at 0 (only 64 live
    tokens precede 192). A prefix with no tombstone at all matches whole, however short.

Sliding-window locks. A request protects its prefix's full KV from eviction (lock_ref, the whole path) but
its sliding-window KV only for the last `window` tokens of the prefix (swa_lock_ref; the node that reaches past
them is split there, at a page boundary): the rest it never reads again, so the pool may tombstone it while the
request runs. inc_lock_ref marks the
topmost node it swa-locked (swa_uuid); dec_lock_ref walks up to that mark, so a node split in between (the
mark moves to the upper half) is unlocked exactly as it was locked.

Eviction makes room in both pools: whole leaves (both KVs) least recently used first while KV slots are
short; while sliding-window slots are short, the least recently used nodes without a sliding-window lock
lose their local KV (an unlocked leaf is removed whole: a tombstone leaf can end no match).

Tokens whose sliding-window KV a request freed while it ran (BasePrefixCache.release_outside_window) enter
the tree as tombstones; a tombstone that a request brings fresh KV for comes back to life with that
request's local KV (insert).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.allocator import round_down_to_page
from radixserve.mem_cache.base_prefix_cache import MatchResult
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

_uuids = itertools.count(1)


class SWARadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
                 page_size: int) -> None:
        self.window = token_to_kv_pool_allocator.swa_window
        self.swa = token_to_kv_pool_allocator
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    def _new_root(self) -> None:
        super()._new_root()
        self._swa_evictable = 0  # local KV of live nodes without a sliding-window lock
        self._swa_locks: dict[TreeNode, list[int]] = {}  # locked node -> the marks of its swa locks, in order
        self.tombstoned_tokens = 0  # cumulative, for get_server_info

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: list[int]) -> MatchResult:
        res = super().match_prefix(key)
        path = self._path(res.last_node)
        end = run = best = 0
        for i, node in enumerate(path):
            end += len(node.value)
            run = 0 if node.swa_tombstone else run + len(node.value)
            if not node.swa_tombstone and (run >= self.window or run == end):
                best = i + 1
        if best == len(path):
            return res
        kept = path[:best]
        indices = torch.cat([n.value for n in kept]) if kept else self._empty()
        return MatchResult(indices, kept[-1] if kept else self.root)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out[::-1]

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """As RadixCache.insert, and: a matched tombstone whose tokens `value` brings local KV for takes that
        local KV over (the caller frees value[owned:returned] as duplicates, as always); new tokens without local
        KV (freed while their request ran) become a tombstone node above the live rest."""
        if len(key) % self.page_size or len(key) != value.numel():
            return super().insert(key, value)  # raises, naming the sizes
        now = self._tick()
        node, path, matched = self._descend(key, now)
        pos = 0
        for n in path:
            span = slice(pos, pos + len(n.value))
            pos = span.stop
            if n.swa_tombstone and bool(self.swa.has_swa(value[span]).all()):
                self._revive(n, value, span)
        rest_key, rest = key[matched:], value[matched:]
        if not rest_key:
            return matched
        bare = (~self.swa.has_swa(rest)).nonzero()
        cut = 0
        if bare.numel():  # the freed ones are a prefix of the new part: tombstone it, up to a page boundary
            cut = min(len(rest_key), -(-(int(bare[-1]) + 1) // self.page_size) * self.page_size)
            self.swa.free_swa(rest[:cut])
            tomb = TreeNode(node, list(rest_key[:cut]), rest[:cut].to(torch.int64).clone(), now)
            tomb.swa_tombstone = True
            node.children[self._child_key(rest_key)] = tomb
            self._evictable += cut
            node = tomb
        if cut < len(rest_key):
            leaf = TreeNode(node, list(rest_key[cut:]), rest[cut:].to(torch.int64).clone(), now)
            node.children[self._child_key(rest_key[cut:])] = leaf
            self._evictable += len(rest_key) - cut
            self._swa_evictable += len(rest_key) - cut
        return matched

    def _revive(self, node: TreeNode, value: torch.Tensor, span: slice) -> None:
        """The tombstone takes over value[span]'s local KV (the same tokens at the same positions): its own KV
        slots, which other requests' rows may name, stay; value's, now without local KV, the caller frees."""
        self.swa.move_swa(value[span], node.value)
        node.swa_tombstone = False
        if node.swa_lock_ref == 0:
            self._swa_evictable += len(node.value)

    # ------------------------------------------------------------------ locking
    def inc_lock_ref(self, node: TreeNode) -> None:
        super().inc_lock_ref(node)
        if node is self.root:
            return
        top, covered, n = node, 0, node
        while n is not self.root and covered < self.window:
            # a node reaching past the window is split at a page boundary: its older part is not locked
            cut = round_down_to_page(len(n.value) - (self.window - covered), self.page_size)
            if cut > 0:
                self._split(n, cut)  # n keeps the newer part
            if n.swa_lock_ref == 0 and not n.swa_tombstone:
                self._swa_evictable -= len(n.value)
            n.swa_lock_ref += 1
            covered += len(n.value)
            top, n = n, n.parent  # type: ignore[assignment]
        if top.swa_uuid is None:
            top.swa_uuid = next(_uuids)
        self._swa_locks.setdefault(node, []).append(top.swa_uuid)

    def dec_lock_ref(self, node: TreeNode) -> None:
        super().dec_lock_ref(node)
        if node is self.root:
            return
        marks = self._swa_locks[node]
        mark = marks.pop()
        if not marks:
            del self._swa_locks[node]
        n = node
        while True:
            n.swa_lock_ref -= 1
            if n.swa_lock_ref == 0 and not n.swa_tombstone:
                self._swa_evictable += len(n.value)
            if n.swa_uuid == mark:
                break
            n = n.parent  # type: ignore[assignment]
            assert n is not self.root, "sliding-window unlock walked past its mark"

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Make available_size() (the smaller pool's free count) grow by num_tokens where the tree can."""
        if num_tokens <= 0:
            return 0
        want = self.swa.available_size() + num_tokens
        freed = 0
        if self.swa.full_available_size() < want:
            freed += super().evict(want - self.swa.full_available_size())
        if self.swa.swa_available_size() < want:
            self._evict_swa(want - self.swa.swa_available_size())
        return freed

    def _evict_swa(self, num_tokens: int) -> None:
        heap = [n for n in self._nodes() if not n.swa_tombstone and n.swa_lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            if not node.children and node.lock_ref == 0:
                freed += self._remove_leaf(node)  # its local KV goes with it
                continue
            self.swa.free_swa(node.value)
            node.swa_tombstone = True
            self._swa_evictable -= len(node.value)
            self.tombstoned_tokens += len(node.value)
            freed += len(node.value)

    def _evicting(self, leaf: TreeNode) -> None:
        if not leaf.swa_tombstone and leaf.swa_lock_ref == 0:
            self._swa_evictable -= len(leaf.value)

    # ------------------------------------------------------------------ sizes
    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def check_swa(self) -> None:
        """Tree side of the local pool's accounting: live nodes hold local KV for every token, tombstones none,
        and the evictable count is what the nodes say."""
        evictable = 0
        for n in self._nodes():
            held = self.swa.has_swa(n.value)
            if n.swa_tombstone and bool(held.any()):
                raise RuntimeError(f"tombstone {n} still holds sliding-window slots")
            if not n.swa_tombstone and not bool(held.all()):
                raise RuntimeError(f"live {n} lacks sliding-window slots")
            if not n.swa_tombstone and n.swa_lock_ref == 0:
                evictable += len(n.value)
            if n.swa_lock_ref > n.lock_ref:
                raise RuntimeError(f"{n}: sliding-window lock {n.swa_lock_ref} > lock {n.lock_ref}")
        if evictable != self._swa_evictable:
            raise RuntimeError(f"swa evictable {self._swa_evictable} != {evictable} counted")

    def info(self) -> dict[str, dict[str, int]]:
        pool = self.swa
        return {"swa": {"full_tokens": pool.total_size, "swa_tokens": pool.swa_total_size,
                        "swa_available_tokens": pool.swa_available_size(), "swa_evictable_tokens": self._swa_evictable,
                        "swa_tombstoned_tokens": self.tombstoned_tokens}}
