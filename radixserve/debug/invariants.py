"""--check-invariants: validate every ForwardBatch and the KV accounting after every step.

Raises InvariantError at the first violation, naming what is wrong, so a bug surfaces at the
step that caused it rather than as a wrong token many steps later.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from radixserve.exceptions import InvariantError

if TYPE_CHECKING:
    from radixserve.managers.req import Req
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.speculative.spec_worker import SpecWorker


def check_forward_batch(fb: ForwardBatch) -> None:
    """Lengths and positions consistent; out_cache_loc is exactly where req_to_token points."""
    if fb.forward_mode.is_idle():
        return
    ext, pre = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
    if [p + e for p, e in zip(pre, ext)] != fb.seq_lens_cpu:
        raise InvariantError(f"prefix + extend != seq_lens: {pre} + {ext} vs {fb.seq_lens_cpu}")
    if sum(ext) != fb.num_tokens or fb.out_cache_loc.numel() != fb.num_tokens or fb.positions.numel() != fb.num_tokens:
        raise InvariantError("input_ids / positions / out_cache_loc lengths differ from sum(extend_seq_lens)")
    expect_pos = torch.cat([torch.arange(p, p + e) for p, e in zip(pre, ext)]) if ext else torch.empty(0)
    if not torch.equal(fb.positions.cpu(), expect_pos.to(torch.int64)):
        raise InvariantError("positions are not arange(prefix_len, seq_len) per request")
    rtt = fb.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices.tolist()
    expect_loc = torch.cat([rtt[r, p : p + e] for r, p, e in zip(rows, pre, ext)])
    if not torch.equal(fb.out_cache_loc.cpu(), expect_loc.cpu()):
        raise InvariantError("out_cache_loc does not match req_to_token[req, prefix_len:seq_len]")
    if (fb.out_cache_loc == 0).any():
        raise InvariantError("out_cache_loc hands out the reserved slot 0")
    if len(set(rows)) != len(rows):
        raise InvariantError("two requests share a req_to_token row")


class InvariantChecker:
    """Checks the KV accounting of the pools and the tree it was given; the scheduler hands it the live
    requests (running + chunked) at each check."""

    def __init__(self, allocator: TokenToKVPoolAllocator, tree_cache: BasePrefixCache,
                 req_to_token_pool: ReqToTokenPool, parallel_state: Any) -> None:
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.parallel_state = parallel_state

    def check_forward_batch(self, fb: ForwardBatch) -> None:
        check_forward_batch(fb)

    def check_same_step_on_every_rank(self, mwb: Any) -> None:
        """Tensor / pipeline parallel: every rank's scheduler must have picked the same step (same requests,
        tokens, positions and KV slots). A digest of it is compared with rank 0's."""
        ps = self.parallel_state
        if ps.world_size == 1:
            return
        h = hashlib.sha1(repr((int(mwb.forward_mode), mwb.input_ids, mwb.req_pool_indices, mwb.seq_lens,
                               mwb.prefix_lens, mwb.out_cache_loc.tolist())).encode()).hexdigest()
        ref = ps.broadcast_object(h)
        if ref != h:
            raise InvariantError(f"{ps.layout.describe(ps.rank)} scheduled a different step than rank 0 "
                                 f"(digest {h[:12]} vs {ref[:12]}): the schedulers diverged")

    def owners(self, live: list[Req]) -> dict[str, set[int]]:
        """Slots by owner: the free list, the tree, and each live request outside the tree."""
        ps = self.allocator.page_size
        tree = set(self.tree_cache.all_slots().tolist())
        out = {"free": self.allocator.free_slot_set(), "tree": tree}
        rtt = self.req_to_token_pool.req_to_token
        for req in live:
            if req.req_pool_idx is None:
                continue
            held = set(rtt[req.req_pool_idx, : req.kv_len].tolist()) - tree
            # a partially filled last page belongs to the request as a whole page
            pages = {x // ps for x in held}
            out[f"req:{req.rid}"] = {p * ps + i for p in pages for i in range(ps)}
        return out

    def check_swa(self, live: list[Req]) -> None:
        """The local pool's slots are each free or mapped once, the tree's live nodes hold them and its tombstones
        none, and each live request still holds them for the positions its next query may see."""
        try:
            self.allocator.check_swa()
            if hasattr(self.tree_cache, "check_swa"):
                self.tree_cache.check_swa()
        except RuntimeError as e:
            raise InvariantError(str(e)) from e
        rtt = self.req_to_token_pool.req_to_token
        for req in live:
            if req.req_pool_idx is None:
                continue
            lo = max(req.swa_freed_len, self.tree_cache.tree_owned_len(req))
            slots = rtt[req.req_pool_idx, lo:req.kv_len]
            if not bool(self.allocator.has_swa(slots).all()):
                raise InvariantError(f"request {req.rid} lacks sliding-window KV in positions [{lo}, {req.kv_len})")

    def check_memory(self, live: list[Req], spec_worker: SpecWorker | None = None) -> None:
        """live: the running requests and the chunked one, every request that may hold KV outside the tree."""
        owners = self.owners(live)
        total = 0
        seen: set[int] = set()
        for name, slots in owners.items():
            dup = seen & slots
            if dup:
                first = next(other for other, held in owners.items() if held & dup)
                raise InvariantError(f"slot(s) {sorted(dup)[:5]} have two owners ({first} and {name})")
            seen |= slots
            total += len(slots)
        if total != self.allocator.total_size:
            raise InvariantError(
                f"KV accounting: free {len(owners['free'])} + tree {len(owners['tree'])} + requests "
                f"{total - len(owners['free']) - len(owners['tree'])} = {total} != total {self.allocator.total_size}"
            )
        if hasattr(self.allocator, "check_swa"):  # a hybrid sliding-window pool (mem_cache/swa_memory_pool.py)
            self.check_swa(live)
        pool = self.req_to_token_pool
        live_rows = {r.req_pool_idx for r in live if r.req_pool_idx is not None}
        free_rows = set(pool.free_slots)
        if live_rows & free_rows or len(live_rows) + len(free_rows) != pool.size:
            raise InvariantError(f"req_to_token rows: {len(live_rows)} live + {len(free_rows)} free != {pool.size}")
        if spec_worker is not None:  # a draft model's own pool: every slot free or held by a running request
            spec_worker.check_memory(live)
