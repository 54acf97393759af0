"""RadixCache: unit tests, a stateful property test against a reference model, and simulated
request lifecycles (admission, chunked prefill, decode, finish/abort) checked step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache


def make(ps: int, num_pages: int = 32, cls: type[BasePrefixCache] = RadixCache) -> tuple[Any, ...]:
    req_pool = ReqToTokenPool(size=4, max_context_len=128)
    alloc = TokenToKVPoolAllocator(num_pages * ps, page_size=ps)
    return req_pool, alloc, cls(req_pool, alloc, ps)


def put(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> tuple[int, torch.Tensor]:
    """Insert key with fresh slots, freeing the duplicates like a caller must."""
    value = alloc.alloc(len(key))
    assert value is not None
    n = cache.insert(key, value)
    alloc.free(value[:n])
    return n, value


def check_tree(cache: RadixCache) -> list[tuple[tuple[int, ...], int]]:
    """Structural invariants; returns (token prefix, slot) for every cached token. (With pages,
    sibling leaves may share token-level prefixes inside their first page: hence a list.)"""
    p, out = cache.page_size, []
    evictable = protected = 0
    stack: list[tuple[Any, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for ck, child in node.children.items():
            n = len(child.key)
            assert child.parent is node and ck == cache._child_key(child.key)
            assert n > 0 and n % p == 0 and child.value.numel() == n and child.value.dtype == torch.int64
            assert child.lock_ref >= 0 and (node is cache.root or child.lock_ref <= node.lock_ref)
            protected += n if child.lock_ref else 0
            evictable += 0 if child.lock_ref else n
            path = prefix
            for tok, slot in zip(child.key, child.value.tolist()):
                path = (*path, tok)
                assert slot % p == (len(path) - 1) % p and slot // p != 0
                out.append((path, slot))
            stack.append((child, path))
    slots = [slot for _, slot in out]
    assert len(set(slots)) == len(slots), "a slot owned by two nodes"
    assert (evictable, protected) == (cache.evictable_size(), cache.protected_size())
    assert cache.total_size() == len(out) == cache.all_slots().numel()
    assert set(cache.all_slots().tolist()) == set(slots)
    return out


# ---------------------------------------------------------------------------- unit tests
def test_match_after_insert_and_split() -> None:
    _, alloc, cache = make(1)
    _, v = put(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.device_indices.tolist() == v.tolist() and m.last_node.key == [1, 2, 3, 4]
    m = cache.match_prefix([1, 2, 9])  # ends inside the node: split at 2
    assert m.device_indices.tolist() == v[:2].tolist() and m.last_node.key == [1, 2]
    assert [c.key for c in m.last_node.children.values()] == [[3, 4]]
    empty = cache.match_prefix([7, 1])
    assert empty.device_indices.numel() == 0 and empty.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root
    n, _ = put(cache, alloc, [1, 2, 5, 6])
    assert n == 2 and sorted(c.key for c in m.last_node.children.values()) == [[3, 4], [5, 6]]
    check_tree(cache)


def test_page_aligned_matches() -> None:
    _, alloc, cache = make(4)
    key = [1, 2, 3, 4, 5, 6, 7, 8]
    _, v = put(cache, alloc, key)
    assert cache.match_prefix(key).device_indices.tolist() == v.tolist()
    assert cache.match_prefix(key[:7]).device_indices.tolist() == v[:4].tolist()  # 7 -> one page
    assert cache.match_prefix([*key[:6], 0, 0]).device_indices.tolist() == v[:4].tolist()
    m = cache.match_prefix([1, 2, 3, 0, 5, 6, 7, 8])  # diverges inside the first page
    assert m.device_indices.numel() == 0 and m.last_node is cache.root
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([4, 5, 6]))
    n, _ = put(cache, alloc, [1, 2, 3, 4, 5, 6, 0, 0])  # shares one page, the second page differs
    assert n == 4
    check_tree(cache)
    assert alloc.available_size() + cache.total_size() == alloc.total_size


@pytest.mark.parametrize("ps", [1, 4])
def test_duplicate_insert_returns_overlap_and_keeps_tree_slots(ps: int) -> None:
    _, alloc, cache = make(ps)
    key = list(range(1, 3 * ps + 1))
    _, v1 = put(cache, alloc, key)
    n, v2 = put(cache, alloc, key)  # put() frees v2[:n]
    assert n == len(key)
    assert cache.match_prefix(key).device_indices.tolist() == v1.tolist()
    assert not set(v2.tolist()) & set(cache.all_slots().tolist())
    assert alloc.available_size() + cache.total_size() == alloc.total_size


def test_lru_eviction_order_and_cascade() -> None:
    _, alloc, cache = make(1)
    put(cache, alloc, [1, 1])  # A
    put(cache, alloc, [2, 2])  # B
    put(cache, alloc, [3, 3])  # C
    put(cache, alloc, [3, 3, 4])  # D under C
    cache.match_prefix([1, 1])  # A becomes the most recent
    assert cache.evict(1) == 2  # B: the oldest leaf (whole node freed)
    assert cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert cache.evict(1) == 1  # D: leaf under C, older than A
    assert cache.evict(2) == 2  # C: became a leaf, older than A
    assert cache.match_prefix([1, 1]).device_indices.numel() == 2
    assert cache.evict(100) == 2 and cache.total_size() == 0
    assert alloc.available_size() == alloc.total_size


def test_locked_nodes_never_evicted_and_sizes() -> None:
    _, alloc, cache = make(1)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [5, 6])
    m = cache.match_prefix([1, 2])  # split; lock only [1, 2]
    cache.inc_lock_ref(m.last_node)
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 3)
    assert cache.evict(100) == 3  # [3] and [5, 6]
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 2
    put(cache, alloc, [1, 2, 3, 4])  # new leaf under a locked node is evictable
    assert cache.evictable_size() == 2
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 2 and cache.protected_size() == 2
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 2)
    check_tree(cache)


def test_split_of_locked_node_keeps_counts() -> None:
    _, alloc, cache = make(1)
    put(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    put(cache, alloc, [1, 2, 9])  # splits the locked node
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    check_tree(cache)
    cache.dec_lock_ref(m.last_node)  # the lock walks through the new upper node too
    assert (cache.protected_size(), cache.evictable_size()) == (0, 5)


def test_reset_returns_everything() -> None:
    _, alloc, cache = make(4)
    put(cache, alloc, list(range(8)))
    put(cache, alloc, list(range(4)) + [9] * 8)
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix(list(range(8))).device_indices.numel() == 0
    assert alloc.available_size() == alloc.total_size
    put(cache, alloc, list(range(8)))
    check_tree(cache)


# ---------------------------------------------------------------------------- property test
class RadixMachine(RuleBasedStateMachine):
    """The reference is exact: {page-aligned token prefix: slots of its last page}. Insert adds to
    it, evict removes exactly what the allocator got back, so match must equal it exactly."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.p = self.page_size
        _, self.alloc, self.cache = make(self.p, num_pages=24)
        self.ref: dict[tuple[int, ...], list[int]] = {}
        self.locks: list[tuple[Any, tuple[int, ...]]] = []  # (node, locked tokens)

    def keys(self) -> st.SearchStrategy[list[int]]:
        # Few distinct pages (two differ only in their last token) so prefixes are shared often,
        # plus a partial tail page that must never be matched or inserted.
        pages = [(0,), (1,), (2,)] if self.p == 1 else [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (2,) * 4]
        whole = st.lists(st.sampled_from(pages), max_size=6).map(lambda ps: [t for pg in ps for t in pg])
        tail = st.lists(st.integers(0, 2), max_size=self.p - 1)
        return st.tuples(whole, tail).map(lambda wt: wt[0] + wt[1])

    def ref_match(self, key: list[int]) -> list[int]:
        out: list[int] = []
        for end in range(self.p, len(key) + 1, self.p):
            slots = self.ref.get(tuple(key[:end]))
            if slots is None:
                break
            out += slots
        return out

    def evict(self, n: int) -> None:
        before, evictable = self.alloc.free_slot_set(), self.cache.evictable_size()
        freed = self.cache.evict(n)
        gone = self.alloc.free_slot_set() - before
        assert len(gone) == freed >= min(n, evictable)
        locked = {t[:end] for _, t in self.locks for end in range(self.p, len(t) + 1, self.p)}
        for prefix in list(self.ref):
            hit = gone.intersection(self.ref[prefix])
            if hit:
                assert hit == set(self.ref[prefix]) and prefix not in locked, "evicted locked content"
                del self.ref[prefix]
        # What is left must still be a tree: every remaining prefix has its parent page.
        assert all(len(k) == self.p or k[: -self.p] in self.ref for k in self.ref)

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        key = data.draw(self.keys())
        key = key[: len(key) - len(key) % self.p]
        value = self.alloc.alloc(len(key))
        if value is None:
            self.evict(len(key))
            value = self.alloc.alloc(len(key))
            if value is None:
                return  # everything left is locked
        expected = len(self.ref_match(key))
        n = self.cache.insert(key, value)
        assert n == expected
        self.alloc.free(value[:n])
        for end in range(n + self.p, len(key) + 1, self.p):
            self.ref[tuple(key[:end])] = value[end - self.p : end].tolist()

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data: st.DataObject, lock: bool) -> None:
        key = data.draw(self.keys())
        indices, node = self.cache.match_prefix(key)
        assert indices.tolist() == self.ref_match(key)
        if lock:
            self.cache.inc_lock_ref(node)
            self.locks.append((node, tuple(key[: indices.numel()])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 40))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref.clear()
        assert self.alloc.available_size() == self.alloc.total_size

    @invariant()
    def consistent(self) -> None:
        check_tree(self.cache)
        ref_slots = {s for slots in self.ref.values() for s in slots}
        assert set(self.cache.all_slots().tolist()) == ref_slots
        assert not ref_slots & self.alloc.free_slot_set()
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.total_size
        locked = {t[:end] for _, t in self.locks for end in range(self.p, len(t) + 1, self.p)}
        assert self.cache.protected_size() == len(locked) * self.p


_SETTINGS = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixPage1 = type("RadixMachinePage1", (RadixMachine,), {"page_size": 1}).TestCase
TestRadixPage1.settings = _SETTINGS
TestRadixPage4 = type("RadixMachinePage4", (RadixMachine,), {"page_size": 4}).TestCase
TestRadixPage4.settings = _SETTINGS


# ---------------------------------------------------------------------------- request lifecycles
@dataclass
class Req:
    """Exactly the fields a prefix cache may touch (the scheduler's Req has many more)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


class Sim:
    """A toy scheduler. `kv[slot]` is the token prefix whose KV the slot holds, so any slot that
    is read after being reused by someone else (or mapped to the wrong tokens) is caught."""

    def __init__(self, cls: type[BasePrefixCache], ps: int, seed: int) -> None:
        self.rng, self.p = random.Random(seed), ps
        self.pool = ReqToTokenPool(size=4, max_context_len=64)
        self.alloc = TokenToKVPoolAllocator((96 // ps if ps == 1 else 40) * ps, page_size=ps)
        self.cache = cls(self.pool, self.alloc, ps)
        self.kv: dict[int, tuple[int, ...]] = {}
        self.running: dict[int, tuple[Req, int, int]] = {}  # row -> (req, chunk, max_new)
        self.systems = [[self.rng.randrange(4) for _ in range(n)] for n in (0, 5, 9, 13)]
        self.seen: list[list[int]] = []

    def held(self, req: Req) -> int:
        """Positions of req's row that hold a slot (all with computed KV)."""
        return (
            len(req.fill_ids) if not req.output_ids else len(req.origin_input_ids) + len(req.output_ids) - 1
        )

    def tree_owned(self, req: Req) -> int:
        n = len(req.prefix_indices)
        return n - n % self.p if isinstance(self.cache, RadixCache) else 0

    def alloc_or_evict(self, prefix: int, seq: int, last: int) -> torch.Tensor | None:
        out = self.alloc.alloc_extend([prefix], [seq], [last])
        if out is None:
            self.cache.evict(seq - prefix + self.p)
            out = self.alloc.alloc_extend([prefix], [seq], [last])
        return out

    def compute(self, req: Req, start: int, slots: torch.Tensor) -> None:
        tokens = req.origin_input_ids + req.output_ids
        self.pool.write(req.req_pool_idx, start, slots)
        for i, slot in enumerate(slots.tolist(), start):
            self.kv[slot] = tuple(tokens[: i + 1])

    def admit(self) -> None:
        if self.seen and self.rng.random() < 0.3:
            prompt = list(self.rng.choice(self.seen))  # an exact repeat: full-prefix hits, duplicates
        else:
            prompt = self.rng.choice(self.systems) + [
                self.rng.randrange(4) for _ in range(self.rng.randint(1, 8))
            ]
        self.seen.append(prompt)
        req = Req(prompt)
        prefix, node = self.cache.match_prefix(prompt[:-1])  # at least one token to compute
        assert prefix.numel() % self.p == 0 and prefix.numel() < len(prompt)
        self.cache.inc_lock_ref(node)
        row = self.pool.alloc()
        assert row is not None
        req.req_pool_idx, req.prefix_indices, req.last_node = row, prefix, node
        req.fill_ids = prompt[: prefix.numel()]
        self.pool.write(row, 0, prefix)
        self.running[row] = (req, self.rng.choice([2, 3, 5, 64]), self.rng.randint(1, 6))

    def step(self, row: int) -> None:
        req, chunk, max_new = self.running[row]
        r2t = self.pool.req_to_token[row]
        if not req.output_ids:  # prefill chunk
            start = len(req.fill_ids)
            end = min(start + chunk, len(req.origin_input_ids))
            out = self.alloc_or_evict(start, end, int(r2t[start - 1]) if start else 0)
            if out is None:
                return self.finish(row, abort=True)
            self.compute(req, start, out)
            req.fill_ids = req.origin_input_ids[:end]
            if end < len(req.origin_input_ids):
                self.cache.cache_unfinished_req(req)
                assert req.prefix_indices.tolist() == r2t[:end].tolist()
            else:
                req.output_ids.append(self.rng.randrange(4))
        else:  # decode: write the KV of the newest token
            seq = len(req.origin_input_ids) + len(req.output_ids)
            out = self.alloc_or_evict(seq - 1, seq, int(r2t[seq - 2]))
            if out is None:
                return self.finish(row, abort=True)
            self.compute(req, seq - 1, out)
            req.output_ids.append(self.rng.randrange(4))
        if len(req.output_ids) >= max_new:
            self.finish(row)

    def finish(self, row: int, abort: bool = False) -> None:
        req, _, _ = self.running.pop(row)
        # An abort mid-prefill passes the computed length; otherwise the default applies.
        self.cache.cache_finished_req(req, kv_len=len(req.fill_ids) if abort and not req.output_ids else None)

    def check(self) -> None:
        tree_slots: set[int] = set()
        if isinstance(self.cache, RadixCache):
            for path, slot in check_tree(self.cache):
                assert self.kv[slot] == path, "tree maps tokens to another prefix's KV"
                tree_slots.add(slot)
        req_pages: set[int] = set()
        locked: set[int] = set()
        for row, (req, _, _) in self.running.items():
            tokens, r2t = req.origin_input_ids + req.output_ids, self.pool.req_to_token[row].tolist()
            held, owned = self.held(req), self.tree_owned(req)
            for i in range(held):
                assert self.kv[r2t[i]] == tuple(tokens[: i + 1])
            assert r2t[:owned] == req.prefix_indices[:owned].tolist()
            assert set(r2t[:owned]) <= tree_slots
            locked |= set(r2t[:owned])
            pages = {s // self.p for s in r2t[owned:held]}
            assert not pages & req_pages and not pages & {s // self.p for s in tree_slots}
            req_pages |= pages
        assert not req_pages & {s // self.p for s in self.alloc.free_slot_set()}
        assert self.cache.protected_size() == len(locked)
        total = self.alloc.available_size() + self.cache.total_size() + len(req_pages) * self.p
        assert total == self.alloc.total_size

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if len(self.running) < 3 and self.rng.random() < 0.35:
                self.admit()
            elif self.running and self.rng.random() < 0.04:
                self.finish(self.rng.choice(list(self.running)), abort=True)
            elif self.running:
                self.step(self.rng.choice(list(self.running)))
            self.check()
        while self.running:
            self.step(next(iter(self.running)))
            self.check()
        assert self.pool.available_size() == self.pool.size
        assert self.cache.protected_size() == 0
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.total_size
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.total_size


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("cls", [RadixCache, ChunkCache])
@pytest.mark.parametrize("seed", range(4))
def test_request_lifecycles(cls: type[BasePrefixCache], ps: int, seed: int) -> None:
    Sim(cls, ps, seed).run(steps=250)
