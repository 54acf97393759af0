"""The hybrid sliding-window pool's parts on their own: SWATokenToKVPoolAllocator (a local slot per token, freed
with its page or early), SWAKVPool's translation, and SWARadixCache's tombstones, window-bounded locks (through
node splits), two-pool eviction and revival; plus a random walk of both checked against their invariants."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.swa_memory_pool import (
    SWAKVPool,
    SWAPlan,
    SWATokenToKVPoolAllocator,
    hybrid_swa_layers,
    plan_swa,
    swa_min_tokens,
)
from radixserve.mem_cache.swa_radix_cache import SWARadixCache
from radixserve.server_args import ServerArgs

WINDOW = 8


def make(full: int = 256, swa: int = 64, ps: int = 1) -> tuple[SWATokenToKVPoolAllocator, SWARadixCache]:
    mapping = torch.zeros(full, dtype=torch.int64)
    alloc = SWATokenToKVPoolAllocator(full, swa, ps, WINDOW, mapping)
    return alloc, SWARadixCache(ReqToTokenPool(4, 128), alloc, ps)


def put(cache: SWARadixCache, alloc: SWATokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    value = alloc.alloc(len(key))
    assert value is not None
    n = cache.insert(key, value)
    alloc.free(value[:n])
    return value


def test_allocator_gives_each_token_a_local_slot_and_frees_it_with_the_page() -> None:
    alloc, _ = make(64, 20, ps=4)
    locs = alloc.alloc(6)  # two pages, six tokens: six local slots
    assert alloc.full_available_size() == 60 - 8 and alloc.swa_available_size() == 19 - 6
    assert bool(alloc.has_swa(locs).all())
    more = alloc.alloc_extend([6], [8], [int(locs[-1])])  # the partial page continues: no new page, two local slots
    assert alloc.full_available_size() == 52 and alloc.swa_available_size() == 11
    alloc.free_swa(locs[:3])  # left the window: local slots back, KV slots kept
    assert alloc.swa_available_size() == 14 and alloc.full_available_size() == 52
    alloc.free(torch.cat([locs, more]))
    assert alloc.swa_available_size() == 19 and alloc.full_available_size() == 60
    alloc.check_swa()
    assert alloc.alloc(20) is None and alloc.full_available_size() == 60  # the local pool refuses: nothing taken
    assert alloc.available_size() == 19 and alloc.slots_needed([0, 5], [1, 6]) == 4  # a new page, a continued one
    assert alloc.slots_needed([1, 2, 3], [2, 3, 4]) == 3  # no new page, but three local slots


def test_pool_translates_the_local_layers_only() -> None:
    pool = SWAKVPool(16, 5, [1], 3, 1, 2, start_layer=0)
    assert [b.shape[0] for b in pool.k_buffer] == [16, 5, 16]
    alloc = SWATokenToKVPoolAllocator(16, 5, 1, WINDOW, pool.full_to_swa)
    loc = alloc.alloc(2)
    k = torch.arange(4.0).view(2, 1, 2)
    for layer in range(3):
        pool.set_kv_buffer(layer, loc, k, k)
    assert torch.equal(pool.k_buffer[0][loc], k) and torch.equal(pool.k_buffer[1][pool.swa_table(loc)], k)
    assert pool.layer_slots(0, loc) is loc and not pool.is_swa_layer(2) and pool.is_swa_layer(1)


def test_match_ends_only_where_the_last_window_is_live() -> None:
    alloc, cache = make()
    put(cache, alloc, list(range(40)))
    assert len(cache.match_prefix(list(range(40))).device_indices) == 40
    # tombstone the oldest part: only a cut at the node boundaries with >= WINDOW live tokens before it remains
    node = cache.match_prefix(list(range(12))).last_node  # splits at 12
    alloc.free_swa(node.value)
    node.swa_tombstone = True
    cache._swa_evictable -= len(node.value)
    cache.check_swa()
    assert len(cache.match_prefix(list(range(40))).device_indices) == 40  # 28 live tokens before 40
    assert len(cache.match_prefix(list(range(16))).device_indices) == 0  # 4 live tokens before 16: no end
    assert len(cache.match_prefix(list(range(30))).device_indices) == 30  # split at 30: 18 live tokens before it
    assert len(cache.match_prefix(list(range(14))).device_indices) == 0  # 2 live tokens before 14


def test_swa_lock_covers_the_last_window_and_unlocks_through_splits() -> None:
    alloc, cache = make()
    put(cache, alloc, list(range(30)))
    leaf = cache.match_prefix(list(range(30))).last_node
    cache.inc_lock_ref(leaf)  # splits the node at 22: only the last WINDOW tokens are swa-locked
    assert leaf.swa_lock_ref == 1 and len(leaf.value) == WINDOW and leaf.parent.swa_lock_ref == 0
    assert cache.swa_evictable_size() == 30 - WINDOW and cache.evictable_size() == 0
    cache.match_prefix(list(range(25)) + [77])  # splits the locked node at 25: the upper half carries the mark
    cache.match_prefix(list(range(5)) + [77])  # and again at 5
    cache.check_swa()
    cache.dec_lock_ref(leaf)
    assert all(n.swa_lock_ref == 0 and n.lock_ref == 0 for n in cache._nodes())
    assert cache.swa_evictable_size() == 30 and cache.evictable_size() == 30
    cache.check_swa()


def test_eviction_tombstones_locked_nodes_outside_the_window_and_removes_unlocked_leaves() -> None:
    alloc, cache = make(full=256, swa=64)
    put(cache, alloc, list(range(40)))
    tail = cache.match_prefix(list(range(40))).last_node
    cache.match_prefix(list(range(32)) + [99])  # nodes [0, 32) and [32, 40)
    cache.inc_lock_ref(tail)  # swa-locks [32, 40) only (8 = WINDOW tokens)
    assert cache.swa_evictable_size() == 32
    put(cache, alloc, [500 + i for i in range(20)])  # an unlocked leaf, newer
    cache.evict(24)  # local slots are the short pool: the oldest unlocked local KV goes, the lock's stays
    assert alloc.swa_available_size() >= 24
    head = tail.parent  # [0, 32): no match can end at it now
    assert len(cache.match_prefix(list(range(32)) + [99]).device_indices) == 0
    assert head.swa_tombstone and not tail.swa_tombstone and head.lock_ref == 1  # full KV kept for the lock
    assert len(cache.match_prefix(list(range(40))).device_indices) == 40  # its last window is live
    cache.check_swa()
    alloc.check_swa()
    cache.dec_lock_ref(tail)


def test_insert_makes_freed_tokens_a_tombstone_and_revives_one_with_fresh_local_kv() -> None:
    alloc, cache = make()
    value = alloc.alloc(24)
    alloc.free_swa(value[:10])  # a request freed them while it ran
    assert cache.insert(list(range(24)), value) == 0
    nodes = sorted(cache._nodes(), key=lambda n: len(n.key))
    assert [(len(n.key), n.swa_tombstone) for n in cache._path(cache.match_prefix(list(range(24))).last_node)] == [
        (10, True), (14, False)]
    cache.check_swa()
    again = alloc.alloc(24)  # another request computed the same tokens: its local KV brings the tombstone back
    n = cache.insert(list(range(24)), again)
    alloc.free(again[:n])
    assert n == 24 and not any(x.swa_tombstone for x in nodes)
    cache.check_swa()
    alloc.check_swa()


def test_random_walk_keeps_both_pools_consistent() -> None:
    rng = random.Random(3)
    alloc, cache = make(full=512, swa=48)
    locked: list = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
            if alloc.available_size() < len(key):
                cache.evict(len(key) - alloc.available_size())
            if alloc.available_size() >= len(key):
                put(cache, alloc, key)
        elif op < 0.7:
            m = cache.match_prefix([rng.randrange(4) for _ in range(rng.randrange(1, 30))])
            cache.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
        elif op < 0.9 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 40))
        cache.check_swa()
        alloc.check_swa()
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(cache.all_slots())
    for node in locked:
        cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.swa_available_size() == 47 and alloc.full_available_size() == 511


def test_plan_picks_the_windowed_layers_and_refuses_nothing_silently() -> None:
    assert hybrid_swa_layers([512, None, 512, 40000], 32768) == [0, 2]  # a window as long as the context: full
    args = ServerArgs(model_path="x", swa_full_tokens_ratio=0.25)
    plan, why = plan_swa(args, {0: 512, 1: None, 2: 512}, 32768)
    assert plan == SWAPlan((0, 2), 512, 0.25) and "2 of 3 layers" in why
    assert plan.swa_tokens(100_000, 1) == 25_000 and plan.swa_tokens(2000, 1) == swa_min_tokens(512, 1) == 1088
    assert plan_swa(args.replace(disable_hybrid_swa_memory=True), {0: 512}, 32768) == (
        None, "--disable-hybrid-swa-memory")
    assert plan_swa(args, {0: None}, 32768)[0] is None


@pytest.mark.parametrize("ratio", [0, -1, 1.5, float("nan"), 1e300, True, "0.5"])
def test_absurd_ratios_are_refused_naming_the_field(ratio) -> None:
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        ServerArgs(model_path="x", swa_full_tokens_ratio=ratio)
