"""RequestSlots: the KV slots behind requests' req_to_token rows, allocated and released as one operation.

The allocator hands out slots; a req_to_token row says which slot holds each position of a request.
The two must change together, so every caller that grows or shrinks a row goes through this object
(the scheduler's ScheduleBatch, the speculative draft model's pool, the benchmarks' RunnerDriver, the
execution tests' HandBatch):

    take_row()                               a free row (None when all are taken)
    alloc(rows, prefix_lens, seq_lens)       slots for positions [prefix_len, seq_len) of each row,
                                             written into the rows; returns them concatenated
                                             (out_cache_loc). All or nothing.
    truncate(row, keep_len, alloc_len)       the undo: positions [keep_len, alloc_len) are given up
    free_row(row, owned_from, alloc_len)     truncate to owned_from, then give the row back

Pages (page_size 4 shown). A row's partial last page is continued before new pages are taken, so
alloc reads the slot of position prefix_len - 1 from the row. truncate frees only the pages that lie
wholly past keep_len: the page holding position keep_len - 1 stays with the row, and the next alloc
continues it (its later slots are the row's to overwrite):

    position   0 1 2 3 | 4 5 6 7 | 8 9 10 .        truncate(row, keep_len=6, alloc_len=11)
    kept       k k k k | k k - - |                  page of positions 4..7 stays (partially used)
    freed                        | x x x  x         pages wholly past position 5 go back
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, round_up_to_page
from radixserve.mem_cache.memory_pool import ReqToTokenPool


class RequestSlots:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size

    # ------------------------------------------------------------------ rows
    def take_row(self) -> int | None:
        return self.req_to_token_pool.alloc()

    def free_row(self, row: int, owned_from: int, alloc_len: int) -> None:
        """Give back the slots the row owns (positions [owned_from, alloc_len); the ones before
        owned_from belong to someone else, e.g. the radix tree) and then the row itself."""
        self.truncate(row, owned_from, alloc_len)
        self.req_to_token_pool.free(row)

    # ------------------------------------------------------------------ slots
    def slots_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """What alloc() takes from the allocator for these lengths, in available_size() units."""
        return self.allocator.slots_needed(prefix_lens, seq_lens)

    def alloc(self, rows: list[int], prefix_lens: list[int], seq_lens: list[int],
              make_room: Callable[[int], object] | None = None) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each row, written into the rows; returns them
        concatenated in row order ([sum(seq_len - prefix_len)] int64). When the pool is short,
        make_room(missing slots) may free some first (the radix cache's evict); None if still short,
        and then nothing was taken or written."""
        need = self.slots_needed(prefix_lens, seq_lens)
        if make_room is not None and self.allocator.available_size() < need:
            make_room(need - self.allocator.available_size())
        rtt = self.req_to_token_pool.req_to_token
        host = self.req_to_token_pool.host  # numpy on CPU: entries without tensor indexing
        table = rtt if host is None else host
        last_locs = [int(table[r, p - 1]) if p > 0 else 0 for r, p in zip(rows, prefix_lens)]
        locs = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if locs is None:
            return None
        if all(s - p == 1 for p, s in zip(prefix_lens, seq_lens)):  # one token each: one scatter
            if host is not None:
                host[rows, prefix_lens] = locs.numpy()
            else:
                rtt[torch.tensor(rows, dtype=torch.int64), torch.tensor(prefix_lens, dtype=torch.int64)] = locs
            return locs
        offset = 0
        for r, p, s in zip(rows, prefix_lens, seq_lens):
            self.req_to_token_pool.write(r, p, locs[offset : offset + s - p])
            offset += s - p
        return locs

    def truncate(self, row: int, keep_len: int, alloc_len: int) -> None:
        """Give up positions [keep_len, alloc_len) of the row: free the pages wholly past keep_len and
        zero those row entries (the diagram above). alloc_len = how far the row was allocated."""
        if alloc_len <= keep_len:
            return
        rtt = self.req_to_token_pool.req_to_token
        first_free = min(round_up_to_page(keep_len, self.page_size), alloc_len)
        if alloc_len > first_free:
            self.allocator.free(rtt[row, first_free:alloc_len].clone())
        rtt[row, keep_len:alloc_len] = 0
