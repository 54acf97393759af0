"""HiRadixCache: the radix cache with a disk tier under it (--enable-hierarchical-cache, SGLang's name).

    memory tier   RadixCache over the KV pool, as without the flag
       |  write: a node's blocks go to disk when it is evicted, when admissions have reused it twice
       |         (write-through-selective), and for every node still unsaved when the server stops
       |  read:  a match that ends in memory goes on through the blocks on disk; those are copied into
       v         fresh pool slots and inserted as a node, so the request sees one longer cached prefix
    disk tier     HiCacheFile (hicache_storage.py): one file per block of `block_tokens` positions

Blocks are aligned to absolute positions [i*B, (i+1)*B), so a node stores the blocks that END inside it:
its last partial block waits for a child (or is lost with the leaf: at most B-1 tokens of a prefix).

Tensor / pipeline parallel: every rank writes its own shard under an identity naming its rank, and every
rank decides the same: the blocks found and the blocks read are agreed with an all-reduce of the minimum,
so a file missing or corrupt on one rank shortens the hit on all of them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from radixserve.mem_cache.cache_namespace import NAMESPACE_SHIFT
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hicache_stop import SHUTDOWN_SAVE_S
from radixserve.mem_cache.hicache_storage import (
    BlockShape,
    HiCacheFile,
    chain_keys,
    folder_fingerprint,
    identity_of,
)
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode
from radixserve.mem_cache.swa_radix_cache import SWARadixCache

if TYPE_CHECKING:
    from radixserve.distributed.parallel_state import ParallelState
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

WRITE_THROUGH_HITS = 2  # admissions reusing a node before it is written to disk (SGLang's selective threshold)
BLOCK_TOKENS = 64  # positions per file; rounded up to whole pages


def block_tokens_for(page_size: int) -> int:
    return -(-BLOCK_TOKENS // page_size) * page_size


class HiRadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator,
                 page_size: int, kv_pool: KVPool, storage: HiCacheFile,
                 namespace_identity: Callable[[int], str | None], parallel_state: ParallelState | None = None) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        if storage.shape.block_tokens % page_size:
            raise ValueError(f"hicache block of {storage.shape.block_tokens} tokens is not whole pages of {page_size}")
        self.kv_pool = kv_pool
        self.storage = storage
        self.block = storage.shape.block_tokens
        self.namespace_identity = namespace_identity  # LoRA uid -> the adapter's identity; None: never stored
        self.ps = parallel_state if parallel_state is not None and parallel_state.world_size > 1 else None
        self._buf = bytearray(storage.shape.file_bytes)  # one block read at a time
        self.memory_evicted_tokens = 0
        self._evictions = 0  # eviction_epoch(): bumped by every evict() that freed something
        self._restore = True

    # ------------------------------------------------------------------ keys
    def _namespace(self, key: list[int]) -> str | None:
        uid = key[0] >> NAMESPACE_SHIFT if key else 0
        return "" if uid == 0 else self.namespace_identity(uid)

    def _agree(self, n: int) -> int:
        """The smallest n over the ranks of the replica (every rank must insert the same node)."""
        if self.ps is None:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        self.ps.all_reduce_min(t)
        return int(t.item())

    # ------------------------------------------------------------------ read: match goes on through the disk
    def match_prefix(self, key: list[int]) -> MatchResult:
        res = super().match_prefix(key)
        m, b = len(res.device_indices), self.block
        n_blocks = len(key) // b
        first = m // b
        if first >= n_blocks or not self._restore:  # nothing a block could add (alike on every rank: equal trees)
            return res
        ns = self._namespace(key)
        found, keys = 0, []
        if ns is not None and len(self.storage):
            keys = chain_keys(self.storage.identity, ns, key, b, n_blocks)
            while first + found < n_blocks and self.storage.contains(keys[first + found]):
                found += 1
        found = self._agree(found)
        if found == 0:
            return res
        if self._load(key, keys, first, found, res):
            res = super().match_prefix(key)
            res.last_node.backed = True  # it came from the disk
        return res

    def _load(self, key: list[int], keys: list[str], first: int, found: int, res: MatchResult) -> bool:
        """Copy blocks first .. first+found-1 into fresh slots and insert them below res.last_node."""
        b, m = self.block, len(res.device_indices)
        need = (first + found) * b - m
        allocator = self.token_to_kv_pool_allocator
        self.inc_lock_ref(res.last_node)  # making room must not evict the prefix we extend
        try:
            if allocator.available_size() < need:
                self.evict(need - allocator.available_size())
            slots = allocator.alloc(need)  # m is whole pages, so position m starts a fresh page
            ok = 0
            if slots is not None:
                for j in range(found):
                    if not self._read_block(keys[first + j], first + j, m, slots):
                        break
                    ok += 1
            ok = self._agree(ok)  # allocation is decided alike on every rank; a read may fail on one
            if ok == 0:
                if slots is not None:
                    allocator.free(slots)
                return False
            keep = (first + ok) * b - m
            if keep < need:
                allocator.free(slots[keep:])
            self.insert(key[: m + keep], torch.cat([res.device_indices, slots[:keep]]))
            self.storage.stats.hit_tokens += keep
            return True
        finally:
            self.dec_lock_ref(res.last_node)

    def _read_block(self, key: str, i: int, m: int, slots: torch.Tensor) -> bool:
        data = self.storage.read_into(key, self._buf)
        if data is None:
            return False
        b = self.block
        lo = max(m - i * b, 0)  # the block's first positions may already be in memory
        dst = slots[i * b + lo - m : (i + 1) * b - m]
        for layer in range(self.kv_pool.num_layers):
            k_buf, v_buf = self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]
            k_buf.index_copy_(0, dst, data[layer, 0, lo:])
            v_buf.index_copy_(0, dst, data[layer, 1, lo:])
        return True

    # ------------------------------------------------------------------ write
    def _path_to(self, node: TreeNode) -> tuple[list[int], torch.Tensor]:
        keys, values = [], []
        while node is not self.root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent  # type: ignore[assignment]
        full = [t for k in reversed(keys) for t in k]
        return full, torch.cat(list(reversed(values))) if values else self._empty()

    def _write_node(self, node: TreeNode) -> None:
        """Queue the blocks that end inside `node`: gathered from the pool now (its slots are valid now),
        written by the storage's thread. The node counts as backed once every block is stored or queued;
        a block the full queue refused leaves it unbacked, to be offered again at the next occasion."""
        full, slots = self._path_to(node)
        end, b = len(full), self.block
        start = end - len(node.key)
        lo, hi = start // b, end // b
        ns = self._namespace(full)
        if lo >= hi or ns is None or self.storage.writes_disabled:
            node.backed = True  # nothing this node could store
            return
        keys = chain_keys(self.storage.identity, ns, full, b, hi)
        shape, complete = self.storage.shape, True
        for i in range(lo, hi):
            if self.storage.known(keys[i]):
                continue
            idx = slots[i * b : (i + 1) * b]
            payload = torch.empty(shape.dims, dtype=shape.dtype)
            for layer in range(self.kv_pool.num_layers):
                torch.index_select(self.kv_pool.k_buffer[layer], 0, idx, out=payload[layer, 0])
                torch.index_select(self.kv_pool.v_buffer[layer], 0, idx, out=payload[layer, 1])
            complete &= self.storage.put(keys[i], payload)
        node.backed = complete

    def _evicting(self, leaf: TreeNode) -> None:
        if not leaf.backed:
            self._write_node(leaf)

    def evict(self, num_tokens: int) -> int:
        freed = super().evict(num_tokens)
        self.memory_evicted_tokens += freed
        self._evictions += freed > 0
        return freed

    def eviction_epoch(self) -> int:
        return self._evictions

    @contextlib.contextmanager
    def memory_only(self) -> Iterator[None]:
        self._restore = False
        try:
            yield
        finally:
            self._restore = True

    def on_prefix_hit(self, node: Any) -> None:
        while node is not self.root:
            node.hit_count += 1
            if node.hit_count >= WRITE_THROUGH_HITS and not node.backed:
                self._write_node(node)
            node = node.parent

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Save every unsaved node (most recently used first) within SHUTDOWN_SAVE_S, then wait for the
        writes. A server killed before this keeps what was written already (writes are atomic)."""
        deadline = time.monotonic() + SHUTDOWN_SAVE_S
        nodes = sorted((n for n in self._nodes() if not n.backed), key=lambda n: (-n.last_access, n.id))
        for node in nodes:
            if time.monotonic() > deadline:
                logger.warning("hicache: stopped saving after %.0f s; %d nodes not saved", SHUTDOWN_SAVE_S,
                               sum(1 for n in nodes if not n.backed))
                break
            self._write_node(node)
        self.storage.close(max(0.5, deadline - time.monotonic()))

    def reset_storage(self) -> None:
        self.storage.clear()
        for node in self._nodes():
            node.backed = False

    def info(self) -> dict[str, Any]:
        memory_tokens = self.total_size()
        return {"hicache": {"memory_tokens": memory_tokens,
                            "memory_bytes": memory_tokens * self.storage.shape.payload_bytes // self.block,
                            "memory_evicted_tokens": self.memory_evicted_tokens,
                            "block_tokens": self.block, **self.storage.info()}}


def hicache_identity(runner: Any) -> dict[str, Any]:
    """What the KV of a token depends on besides its prefix: the weights, how they run, and this rank's shard."""
    args, ps = runner.server_args, runner.parallel_state
    return {"model": folder_fingerprint(runner.model_path), "dtype": str(runner.dtype),
            "act_dtype": str(runner.act_dtype), "quantization": runner.quantization,
            "kv_dtype": str(runner.kv_cache_dtype), "deterministic": runner.deterministic,
            "tp": [runner.tp_size, runner.tp_rank], "pp": [args.pp_size, ps.pp_rank],
            "layers": [runner.stage_layers.start, runner.stage_layers.stop]}


def make_tree_cache(runner: Any) -> BasePrefixCache:
    """The scheduler's prefix cache over this runner's pools: ChunkCache (--disable-radix-cache), RadixCache,
    SWARadixCache (a hybrid sliding-window pool), or HiRadixCache (--enable-hierarchical-cache; a ValueError naming --hicache-storage-dir when the directory
    cannot hold it)."""
    args = runner.server_args
    if args.disable_radix_cache:
        return ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, args.page_size)
    if runner.token_to_kv_pool.hybrid:  # a sliding-window pool (the disk tier turned it off: plan_swa)
        return SWARadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, args.page_size)
    if not args.enable_hierarchical_cache:
        return RadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, args.page_size)
    return make_hiradix_cache(runner, args.page_size)


def make_hiradix_cache(runner: Any, page_size: int) -> HiRadixCache:
    args, pool = runner.server_args, runner.token_to_kv_pool
    # a row as the pool stores it (an int8 pool's: q8_0 blocks, kept as they are)
    shape = BlockShape(pool.num_layers, block_tokens_for(page_size), pool.num_kv_heads, pool.row_width, pool.dtype)
    identity = identity_of(hicache_identity(runner))
    storage = HiCacheFile(args.hicache_storage_dir, identity, shape, int(args.hicache_size * 2**30))
    lora = runner.lora_manager
    adapters: dict[int, str | None] = {}

    def namespace_identity(uid: int) -> str | None:
        """A LoRA adapter's files, read once per registration (uids are never reused)."""
        if uid not in adapters:
            reg = lora.regs.get(uid) if lora is not None else None
            try:
                adapters[uid] = None if reg is None else identity_of({"lora": folder_fingerprint(reg.config.path)})
            except OSError:
                adapters[uid] = None  # its files are gone: its prefixes are not stored
        return adapters[uid]

    return HiRadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, page_size, pool, storage,
                        namespace_identity, runner.parallel_state)
