"""RadixCache: a radix tree over token ids whose nodes own the KV slots of their tokens.

    root
     |-- [1 2 3 4 | 5 6 7 8]  slots [40 41 42 43 | 12 13 14 15]      (page_size 4)
     |       |-- [9 10 11 12]        slots [60 61 62 63]
     |       `-- [20 21 22 23]       slots [8 9 10 11]
     `-- [7 7 7 7]            slots [44 45 46 47]

Children are keyed by their first page (a token id when page_size is 1, else a tuple of
page_size ids), so siblings never share a first page and a match walks one child per level.
Every key and value length is a multiple of page_size; splits happen on page boundaries only.

A node is protected while lock_ref > 0 (a running request holds it or a descendant); the
counters evictable/protected are updated on every lock transition 0 <-> 1 so that
evictable_size() + protected_size() == total_size() without walking the tree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.allocator import round_down_to_page
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult
from radixserve.mem_cache.cache_namespace import namespaced

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import ReqToTokenPool

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("backed", "children", "hit_count", "id", "key", "last_access", "lock_ref", "parent", "swa_lock_ref",
                 "swa_tombstone", "swa_uuid", "value")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor, now: int) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this edge (not the full prefix)
        self.value = value  # KV slots of those tokens, same length, owned by this node
        self.lock_ref = 0
        self.last_access = now
        self.id = next(_node_ids)  # tie-break for the LRU heap: deterministic eviction order
        # the disk tier (hiradix_cache.py): admissions that reused this node, and whether its blocks are on disk
        self.hit_count = 0
        self.backed = False
        # the sliding-window pool (swa_radix_cache.py): KV of the local layers freed, requests whose window
        # covers this node, and the mark that ends an unlock's walk
        self.swa_tombstone = False
        self.swa_lock_ref = 0
        self.swa_uuid: int | None = None

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


class RadixCache(BasePrefixCache):
    """The sharing prefix cache. Beyond the base invariants: a node's last_access is >= that of
    any descendant (every access touches the whole path), so LRU over leaves never strands an
    old interior node behind a newer leaf."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        self._clock = 0
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode(None, [], self._empty(), 0)
        self._evictable = 0
        self._protected = 0

    def _tick(self) -> int:
        # A logical clock instead of wall time: LRU order is exact and tests are deterministic.
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ helpers
    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Common prefix length of a and b, rounded down to whole pages."""
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return round_down_to_page(i, self.page_size)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut child's edge at `at` (a page boundary); returns the new upper node.

            parent -> child[k0 .. k_at-1 | k_at .. kn]
            parent -> new[k0 .. k_at-1] -> child[k_at .. kn]

        The new node inherits lock_ref and last_access: whoever locked child also locked
        everything above it, so the counters need no update."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % self.page_size == 0
        new = TreeNode(parent, child.key[:at], child.value[:at], child.last_access)
        new.lock_ref = child.lock_ref
        new.hit_count, new.backed = child.hit_count, child.backed  # both halves were hit and stored alike
        new.swa_tombstone, new.swa_lock_ref = child.swa_tombstone, child.swa_lock_ref
        # a sliding-window unlock walks up to the node carrying its mark: the top half, now
        new.swa_uuid, child.swa_uuid = child.swa_uuid, None
        child.key, child.value = child.key[at:], child.value[at:]
        child.parent = new
        new.children[self._child_key(child.key)] = child
        parent.children[self._child_key(new.key)] = new
        return new

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: list[int]) -> MatchResult:
        key = key[: round_down_to_page(len(key), self.page_size)]
        node, path, _ = self._descend(key, self._tick())
        indices = torch.cat([n.value for n in path]) if path else self._empty()
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        if len(key) % self.page_size or len(key) != value.numel():
            raise ValueError(
                f"insert: key of {len(key)} tokens, value of {value.numel()} slots, page {self.page_size}"
            )
        now = self._tick()
        node, _, matched = self._descend(key, now)
        key, value = key[matched:], value[matched:]
        if key:
            # clone: value is usually a view of a req_to_token row, which is zeroed on free.
            leaf = TreeNode(node, list(key), value.to(torch.int64).clone(), now)
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return matched

    def _descend(self, key: list[int], now: int) -> tuple[TreeNode, list[TreeNode], int]:
        """Walk `key`'s longest cached prefix from the root: (its last node, the nodes on the way, tokens
        matched). A node matched in part is split at the match, and every node on the way is touched at `now`,
        after the split, so the unmatched lower part keeps its age."""
        node, path, matched = self.root, [], 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)  # n >= page_size: the first page matched
            child.last_access = now
            path.append(child)
            matched += n
            node, key = child, key[n:]
        return node, path, matched

    # ------------------------------------------------------------------ request hand-off
    def cache_finished_req(self, req: CacheReq, kv_len: int | None = None) -> None:
        token_ids = namespaced(req.origin_input_ids + req.output_ids, getattr(req, "lora_uid", 0))
        if kv_len is None:
            kv_len = len(token_ids) - 1
        p = self.page_size
        owned_by_tree = self.tree_owned_len(req)
        if not len(req.prefix_indices) <= kv_len <= len(token_ids):
            raise ValueError(
                f"cache_finished_req: kv_len {kv_len} not in [{len(req.prefix_indices)}, {len(token_ids)}]"
            )
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len].clone()
        aligned = kv_len - kv_len % p
        #   0 ...... owned_by_tree ...... new_prefix_len ...... aligned ...... kv_len
        #   | tree's (locked) |  duplicates: free  |  -> tree (insert)  | tail: free |
        new_prefix_len = self.insert(token_ids[:aligned], slots[:aligned])
        allocator = self.token_to_kv_pool_allocator
        if new_prefix_len > owned_by_tree:
            allocator.free(slots[owned_by_tree:new_prefix_len])
        allocator.free(slots[aligned:kv_len])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        fill_len = len(req.fill_ids)
        p = self.page_size
        owned_by_tree = self.tree_owned_len(req)
        row = req.req_pool_idx
        slots = self.req_to_token_pool.req_to_token[row, :fill_len].clone()
        aligned = fill_len - fill_len % p
        key = namespaced(list(req.fill_ids[:aligned]), getattr(req, "lora_uid", 0))
        # Same picture as cache_finished_req, except the tail stays with the request.
        new_prefix_len = self.insert(key, slots[:aligned])
        if new_prefix_len > owned_by_tree:
            self.token_to_kv_pool_allocator.free(slots[owned_by_tree:new_prefix_len])
        tree_slots, new_node = RadixCache.match_prefix(self, key)  # the memory tier, whole: what insert just made
        assert tree_slots.numel() == aligned, "insert() never evicts, so the re-match is complete"
        # The row must point at tree-owned slots: the duplicates it held were just freed.
        self.req_to_token_pool.write(row, owned_by_tree, tree_slots[owned_by_tree:aligned])
        self.inc_lock_ref(new_node)  # lock the new path before unlocking the old one
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([tree_slots, slots[aligned:fill_len]])
        req.last_node = new_node

    # ------------------------------------------------------------------ locking
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        # Checking the start node suffices: an ancestor's lock_ref is >= its child's.
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.value)
                self._protected -= len(node.value)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]  # without the root

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            # An unlocked parent that just lost its last child is now an LRU candidate too.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> int:
        """Free an unlocked leaf's slots and cut it from the tree; returns the slots freed."""
        self._evicting(leaf)
        self.token_to_kv_pool_allocator.free(leaf.value)
        self._evictable -= len(leaf.value)
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key)]
        return len(leaf.value)

    def _evicting(self, leaf: TreeNode) -> None:
        """Called with a leaf whose slots are about to be freed (its parent path still in memory): the
        disk tier writes it back here."""

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} slots still locked")
        self.token_to_kv_pool_allocator.free(self.all_slots())
        self._new_root()

