"""HiRadixCache without a model: random inserts, matches, evictions and restarts over a small pool whose KV
encodes the prefix that computed it, so a slot the cache returns can be checked exactly. Whatever the cache
restores from disk (after evictions, after a restart over a zeroed pool) must hold the KV of that very prefix,
and no slot may be lost or owned twice."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, round_down_to_page
from radixserve.mem_cache.hicache_storage import BlockShape, HiCacheFile
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool

LAYERS, HEADS, DIM = 2, 1, 2


def code(prefix: list[int]) -> float:
    """The 'KV' of the last token of `prefix`: a function of the whole prefix, as real KV is."""
    return float(int.from_bytes(hashlib.sha256(bytes(str(prefix), "ascii")).digest()[:3], "little"))


class World:
    def __init__(self, root: str, page: int, block: int, slots: int) -> None:
        self.root, self.page, self.block, self.slots = root, page, block, slots
        self.boot()

    def boot(self) -> None:
        """A fresh process: zeroed pools, the disk tier reopened on the same folder."""
        self.alloc = TokenToKVPoolAllocator(self.slots, self.page)
        self.pool = KVPool(self.alloc.size, LAYERS, HEADS, DIM)
        storage = HiCacheFile(self.root, "a" * 64, BlockShape(LAYERS, self.block, HEADS, DIM, torch.float32), 2**30)
        self.cache = HiRadixCache(ReqToTokenPool(2, 64), self.alloc, self.page, self.pool, storage, lambda uid: None)

    def check(self, key: list[int], slots: torch.Tensor) -> None:
        for i, s in enumerate(slots.tolist()):
            want = code(key[: i + 1])
            for layer in range(LAYERS):
                assert self.pool.k_buffer[layer][s, 0, 0].item() == want + layer, (i, s)
                assert self.pool.v_buffer[layer][s, 0, 1].item() == -want - layer, (i, s)

    def check_accounting(self) -> None:
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.total_size
        assert self.cache.protected_size() == 0

    def add(self, key: list[int]) -> int:
        """What cache_finished_req does for a request of prompt `key` whose KV is all computed."""
        res = self.cache.match_prefix(key)
        m = len(res.device_indices)
        self.check(key, res.device_indices)
        aligned = round_down_to_page(len(key), self.page)
        self.cache.inc_lock_ref(res.last_node)
        try:
            need = aligned - m
            if need and self.alloc.available_size() < need:
                self.cache.evict(need - self.alloc.available_size())
            new = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
            if new is None:
                return m
            for i, s in enumerate(new.tolist()):  # "compute" the suffix's KV
                c = code(key[: m + i + 1])
                for layer in range(LAYERS):
                    self.pool.k_buffer[layer][s] = torch.tensor([[c + layer, 0.0]])
                    self.pool.v_buffer[layer][s] = torch.tensor([[0.0, -c - layer]])
            got = self.cache.insert(key[:aligned], torch.cat([res.device_indices, new]))
            assert got == m
        finally:
            self.cache.dec_lock_ref(res.last_node)
        return m


@pytest.mark.parametrize("seed, page", [(0, 1), (1, 1), (2, 4), (3, 4), (4, 2)])
def test_random_traffic_restores_the_right_kv(tmp_path, seed, page) -> None:
    rng = random.Random(seed)
    block = 8 if page < 8 else page
    world = World(str(tmp_path), page, block, slots=160)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    hits_from_disk = 0
    for step in range(120):
        op = rng.random()
        if op < 0.65:
            key = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
            before = world.cache.storage.stats.hit_tokens
            world.add(key)
            hits_from_disk += world.cache.storage.stats.hit_tokens - before
        elif op < 0.85:
            world.cache.evict(rng.randrange(1, 60))
        elif op < 0.95:
            world.cache.storage.flush()
        else:
            world.cache.close()  # a stop: every unsaved node written
            world.boot()  # a restart over a zeroed pool: only the disk remembers
        world.check_accounting()
    # every stem once more after a last restart: what comes back is right, and something does
    world.cache.close()
    world.boot()
    for stem in stems:
        world.add(stem)
        world.check_accounting()
    assert hits_from_disk + world.cache.storage.stats.hit_tokens > 0
    world.cache.storage.close()
