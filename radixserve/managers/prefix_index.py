"""PrefixIndex: the token ids of a replica's recent prompts, as a bounded radix tree (the router's guess
of what that replica's radix cache holds).

    match(ids)  -> how many leading tokens of ids some indexed prompt shares   (no state change)
    insert(ids) -> index a prompt routed to this replica; the least recently used leaves go when the
                   index holds more than `capacity` tokens

It stores token ids only -- no KV, no lock counts -- and is never told what the replica evicts: the
capacity is the replica's KV pool size, so the index never claims more than the pool could hold, and the
LRU order follows the one the replica's own cache evicts by (the oldest prompts go first).
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key: list[int], parent: _Node | None, tick: int) -> None:
        self.key = key  # the edge's tokens, from the parent to this node
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.parent = parent
        self.last_access = tick


def _common_len(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b[start:]."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start:start + n]:  # the usual case, compared at C speed
        return n
    i = 0
    while a[i] == b[start + i]:
        i += 1
    return i


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity  # tokens
        self.size = 0  # tokens on all edges
        self._tick = itertools.count(1)
        self.root = _Node([], None, 0)

    def match(self, ids: list[int]) -> int:
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common_len(child.key, ids, i)
            i += n
            if n < len(child.key):
                break
            node = child
        return i

    def insert(self, ids: list[int]) -> None:
        tick = next(self._tick)
        node, i = self.root, 0
        while i < len(ids):
            node.last_access = tick
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(list(ids[i:]), node, tick)
                node.children[ids[i]] = leaf
                self.size += len(leaf.key)
                break
            n = _common_len(child.key, ids, i)
            if n < len(child.key):  # split the edge: node -> mid (shared part) -> child (the rest)
                mid = _Node(child.key[:n], node, tick)
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[ids[i]] = mid
                child = mid
            i += n
            node = child
        node.last_access = tick
        if self.size > self.capacity:
            self._evict(self.size - self.capacity)

    def _evict(self, num_tokens: int) -> None:
        """Drop least recently used leaves until num_tokens tokens are gone (a parent left childless
        becomes a leaf and may go too)."""
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.size -= freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def clear(self) -> None:
        self.root = _Node([], None, 0)
        self.size = 0
