"""RequestSlots under random grow / truncate / release sequences, page_size 1 and 4: every position a row
holds has a slot whose offset in its page is the position's, the pages a row holds are exactly those its
positions 0 .. len - 1 touch (truncate keeps a partly used last page, gives back the rest), no page has
two holders, and free + held == total at every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.request_slots import RequestSlots

NUM_PAGES, ROWS, WIDTH = 12, 4, 40


class RequestSlotsMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(NUM_PAGES * ps, page_size=ps)
        self.pool = ReqToTokenPool(ROWS, WIDTH)
        self.slots = RequestSlots(self.pool, self.alloc)
        self.lens: dict[int, int] = {}  # row -> positions it holds

    def held_pages(self, row: int) -> set[int]:
        return {int(s) // self.page_size for s in self.pool.req_to_token[row, : self.lens[row]].tolist()}

    @rule()
    def take_row(self) -> None:
        row = self.slots.take_row()
        assert (row is None) == (len(self.lens) == ROWS)
        if row is not None:
            self.lens[row] = 0

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.lens)), min_size=1, max_size=ROWS, unique=True))
        new = [data.draw(st.integers(0, 9)) for _ in rows]
        prefix = [self.lens[r] for r in rows]
        seq = [min(WIDTH, p + n) for p, n in zip(prefix, new)]
        before = self.alloc.available_size()
        need = self.slots.slots_needed(prefix, seq)
        locs = self.slots.alloc(rows, prefix, seq)
        if locs is None:
            assert need > before and self.alloc.available_size() == before  # all or nothing
            return
        assert before - self.alloc.available_size() == need
        assert locs.numel() == sum(seq) - sum(prefix)
        off = 0
        for r, p, s in zip(rows, prefix, seq):
            assert torch.equal(self.pool.req_to_token[r, p:s], locs[off : off + s - p])  # the row is written
            off += s - p
            self.lens[r] = s

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.lens)))
        keep = data.draw(st.integers(0, self.lens[row]))
        self.slots.truncate(row, keep, self.lens[row])
        self.lens[row] = keep
        assert not self.pool.req_to_token[row, keep:].any()

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free_row(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.lens)))
        self.slots.free_row(row, 0, self.lens.pop(row))

    @invariant()
    def accounting(self) -> None:
        ps = self.page_size
        seen: set[int] = set()
        for row, n in self.lens.items():
            slots = self.pool.req_to_token[row, :n].tolist()
            assert all(s % ps == i % ps and s >= ps for i, s in enumerate(slots))  # never page 0
            pages = self.held_pages(row)
            assert not pages & seen, "a page has two holders"
            seen |= pages
        free = {s // ps for s in self.alloc.free_slot_set()}
        assert not free & seen
        assert len(free) + len(seen) == NUM_PAGES - 1  # page 0 is reserved


class RequestSlotsPaged(RequestSlotsMachine):
    page_size = 4


@pytest.mark.parametrize("machine", [RequestSlotsMachine, RequestSlotsPaged], ids=["page1", "page4"])
def test_request_slots(machine) -> None:
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    case().runTest()
