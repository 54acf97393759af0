"""TokenToKVPoolAllocator: owns the free KV slots, handed out in pages of `page_size`.

A request's token at position p lives in a slot whose offset inside its page is p % page_size,
so a page is owned by exactly one request (or one radix-tree node) and prefixes can be shared
in whole pages:

    page_size = 4        page 7            page 2            page 9
    request tokens   [t0 t1 t2 t3]     [t4 t5 t6 t7]     [t8 .  .  . ]
    slots            28 29 30 31       8  9  10 11       36 -- free for t9..t11 of this request

alloc_extend()/alloc_decode() continue a request's last partial page before taking new pages.
Every method returns None instead of raising when the pool is short: the scheduler then evicts
from the radix cache or retracts a request.
"""

from __future__ import annotations

import torch


def round_up_to_page(num_tokens: int, page_size: int) -> int:
    """Slots that `num_tokens` positions occupy in whole pages."""
    return -(-num_tokens // page_size) * page_size


def round_down_to_page(num_tokens: int, page_size: int) -> int:
    """The whole pages within `num_tokens` positions (what a prefix cache can hold of them)."""
    return num_tokens - num_tokens % page_size


def pages_between(prefix_len: int, seq_len: int, page_size: int) -> int:
    """New pages a request takes to grow from prefix_len to seq_len positions (its partial last
    page is continued first)."""
    return (round_up_to_page(seq_len, page_size) - round_up_to_page(prefix_len, page_size)) // page_size


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = size // page_size
        if self.num_pages < 2:
            raise ValueError(f"a KV pool of {size} slots holds fewer than 2 pages of {page_size}")
        self.size = self.num_pages * page_size  # slots, including the reserved page 0
        self.device = torch.device(device)
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        # NOTE: page 0 is reserved (padding target), so it never enters the free list.
        self.free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))
        self._free_set: set[int] = set(self.free_pages)

    @property
    def total_size(self) -> int:
        """Slots that can ever be handed out (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def slots_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """Slots (in whole pages) that alloc_extend takes for these lengths."""
        ps = self.page_size
        return ps * sum(pages_between(p, s, ps) for p, s in zip(prefix_lens, seq_lens))

    def full_available_size(self) -> int:
        """Free KV slots (a hybrid pool's available_size() is also bounded by its sliding-window slots)."""
        return self.available_size()

    def free_slot_set(self) -> set[int]:
        ps = self.page_size
        return {p * ps + i for p in self._free_set for i in range(ps)}

    # ------------------------------------------------------------------ alloc
    def _take_pages(self, n: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[-n:] if n else []
        del self.free_pages[len(self.free_pages) - n :]
        self._free_set.difference_update(pages)
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens starting on a fresh page (a new request, no prefix)."""
        num_pages = pages_between(0, num_tokens, self.page_size)
        pages = self._take_pages(num_pages)
        if pages is None:
            return None
        return self._slots_from_pages(pages, 0, num_tokens)

    def _slots_from_pages(self, pages: list[int], offset: int, num_tokens: int) -> torch.Tensor:
        ps = self.page_size
        if ps == 1:
            return torch.tensor(pages, dtype=torch.int64, device=self.device)
        base = torch.tensor(pages, dtype=torch.int64).repeat_interleave(ps) * ps + torch.arange(ps).repeat(len(pages))
        return base[offset : offset + num_tokens].to(self.device)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated.

        last_locs[i] is the slot of position prefix_len-1 (ignored when prefix_len is 0); the
        request's partial last page is filled first. All or nothing: on shortage nothing is taken.
        """
        ps = self.page_size
        need_pages = [pages_between(p, s, ps) for p, s in zip(prefix_lens, seq_lens)]
        pages = self._take_pages(sum(need_pages))
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for p, s, last, n_new in zip(prefix_lens, seq_lens, last_locs, need_pages):
            n_tokens = s - p
            if n_tokens <= 0:
                continue
            head = 0
            if p % ps:
                # continue the partial page: slots last+1 .. end of that page
                head = min(ps - p % ps, n_tokens)
                out.append(torch.arange(last + 1, last + 1 + head, dtype=torch.int64, device=self.device))
            if n_tokens - head:
                out.append(self._slots_from_pages(pages[cursor : cursor + n_new], 0, n_tokens - head))
            cursor += n_new
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return out[0] if len(out) == 1 else torch.cat(out)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len-1 (the token this DECODE step writes)."""
        if self.page_size == 1:
            return self.alloc(len(seq_lens))
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    # ------------------------------------------------------------------ free
    def free(self, slots: torch.Tensor) -> None:
        """Return the pages holding `slots`. A page is owned by one holder, so freeing any of its
        slots frees the whole page; callers pass all of a holder's slots in that page."""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size).tolist()
        for page in pages:
            if page == 0:
                raise ValueError("TokenToKVPoolAllocator.free: slot in reserved page 0")
            if page in self._free_set:
                raise ValueError(f"TokenToKVPoolAllocator.free: page {page} freed twice")
        self.free_pages.extend(pages)
        self._free_set.update(pages)
