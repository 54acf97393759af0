"""TokenToKVPoolAllocator under random alloc / alloc_extend / alloc_decode / free sequences.

The model: a list of simulated requests, each holding the slots of its positions 0..len-1 (and
so whole pages: its last page may be partially used, the rest of it reserved for it).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator

NUM_PAGES = 10  # small, so shortage is common


def pages_of(slots: list[int], ps: int) -> set[int]:
    return {s // ps for s in slots}


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(NUM_PAGES * ps, page_size=ps)
        self.reqs: list[list[int]] = []  # slot of each position, per request

    # ------------------------------------------------------------------ helpers
    def held_pages(self) -> set[int]:
        out: set[int] = set()
        for slots in self.reqs:
            out |= pages_of(slots, self.page_size)
        return out

    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        ps = self.page_size
        return -(-seq_len // ps) - -(-prefix_len // ps)

    def check_new_slots(self, new: list[int], start: int, held_before: set[int], own: set[int]) -> None:
        """new[i] is the slot of position start+i of one request that already held pages `own`."""
        ps = self.page_size
        assert len(set(new)) == len(new)
        for i, slot in enumerate(new):
            assert slot // ps != 0, "page 0 is reserved"
            assert slot % ps == (start + i) % ps, "slot offset in its page must equal position offset"
            page = slot // ps
            # A slot either continues this request's own partial page or comes from a free page.
            assert page in own or page not in held_before

    def extend(self, idxs: list[int], ns: list[int]) -> None:
        prefix = [len(self.reqs[i]) for i in idxs]
        seq = [p + n for p, n in zip(prefix, ns)]
        last = [self.reqs[i][-1] if self.reqs[i] else 0 for i in idxs]
        avail = self.alloc.available_size()
        held = self.held_pages()
        out = self.alloc.alloc_extend(prefix, seq, last)
        need = sum(self.pages_needed(p, s) for p, s in zip(prefix, seq))
        if out is None:
            assert need * self.page_size > avail
            assert self.alloc.available_size() == avail, "a failed alloc takes nothing"
            return
        assert out.dtype == torch.int64 and out.numel() == sum(ns)
        assert self.alloc.available_size() == avail - need * self.page_size
        flat = out.tolist()
        cursor = 0
        for i, p, n in zip(idxs, prefix, ns):
            new = flat[cursor : cursor + n]
            cursor += n
            self.check_new_slots(new, p, held, pages_of(self.reqs[i], self.page_size))
            self.reqs[i].extend(new)

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(0, 40))
    def alloc_new(self, n: int) -> None:
        avail = self.alloc.available_size()
        held = self.held_pages()
        out = self.alloc.alloc(n)
        need = -(-n // self.page_size)
        if out is None:
            assert need * self.page_size > avail and self.alloc.available_size() == avail
            return
        assert out.numel() == n
        assert self.alloc.available_size() == avail - need * self.page_size
        self.check_new_slots(out.tolist(), 0, held, set())
        self.reqs.append(out.tolist())

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def alloc_extend(self, data: st.DataObject) -> None:
        idxs = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, max_size=3, unique=True))
        ns = data.draw(
            st.lists(st.integers(0, 2 * self.page_size + 3), min_size=len(idxs), max_size=len(idxs))
        )
        self.extend(idxs, ns)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def alloc_decode(self, data: st.DataObject) -> None:
        idxs = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, max_size=3, unique=True))
        idxs = [i for i in idxs if self.reqs[i]]  # decode continues an existing sequence
        if not idxs:
            return
        seq = [len(self.reqs[i]) + 1 for i in idxs]
        last = [self.reqs[i][-1] for i in idxs]
        avail = self.alloc.available_size()
        held = self.held_pages()
        out = self.alloc.alloc_decode(seq, last)
        need = sum(self.pages_needed(s - 1, s) for s in seq)
        if out is None:
            assert need * self.page_size > avail and self.alloc.available_size() == avail
            return
        assert out.numel() == len(idxs)
        for i, s, slot in zip(idxs, seq, out.tolist()):
            self.check_new_slots([slot], s - 1, held, pages_of(self.reqs[i], self.page_size))
            self.reqs[i].append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        slots = self.reqs.pop(i)
        avail = self.alloc.available_size()
        self.alloc.free(torch.tensor(slots, dtype=torch.int64))
        assert self.alloc.available_size() == avail + len(pages_of(slots, self.page_size)) * self.page_size
        if slots:
            # Freeing again is caught and changes nothing.
            with pytest.raises(ValueError):
                self.alloc.free(torch.tensor(slots[:1], dtype=torch.int64))
            assert (
                self.alloc.available_size() == avail + len(pages_of(slots, self.page_size)) * self.page_size
            )

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting(self) -> None:
        held = self.held_pages()
        all_slots = [s for slots in self.reqs for s in slots]
        assert len(all_slots) == len(set(all_slots)), "a slot handed out twice"
        assert 0 not in held
        free_pages = {s // self.page_size for s in self.alloc.free_slot_set()}
        assert not held & free_pages
        # Pages are owned whole, so requests' pages + free pages cover the pool exactly.
        assert self.alloc.available_size() + len(held) * self.page_size == self.alloc.total_size


_SETTINGS = settings(
    max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _machine_for(ps: int) -> type[AllocatorMachine]:
    return type(f"AllocatorMachinePage{ps}", (AllocatorMachine,), {"page_size": ps})


TestAllocatorPage1 = _machine_for(1).TestCase
TestAllocatorPage1.settings = _SETTINGS
TestAllocatorPage4 = _machine_for(4).TestCase
TestAllocatorPage4.settings = _SETTINGS
TestAllocatorPage16 = _machine_for(16).TestCase
TestAllocatorPage16.settings = _SETTINGS


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_clear_restores_everything_but_page_0(ps: int) -> None:
    alloc = TokenToKVPoolAllocator(8 * ps, page_size=ps)
    assert alloc.total_size == 7 * ps
    assert alloc.alloc(alloc.total_size + 1) is None
    out = alloc.alloc(alloc.total_size)
    assert out is not None and sorted(out.tolist()) == list(range(ps, 8 * ps))
    assert alloc.available_size() == 0 and alloc.alloc(1) is None
    alloc.clear()
    assert alloc.available_size() == alloc.total_size


def test_free_rejects_reserved_page() -> None:
    alloc = TokenToKVPoolAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([2]))
