"""ReqToTokenPool rows and KVPool buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool


def test_rows_alloc_until_full_then_none() -> None:
    pool = ReqToTokenPool(size=4, max_context_len=8)
    rows = [pool.alloc() for _ in range(4)]
    assert sorted(rows) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert pool.available_size() == 0
    assert pool.alloc() is None
    pool.free(rows[1])  # type: ignore[arg-type]
    assert pool.available_size() == 1
    assert pool.alloc() == rows[1]


def test_free_rejects_unallocated_and_double_free() -> None:
    pool = ReqToTokenPool(size=2, max_context_len=4)
    with pytest.raises(ValueError):
        pool.free(0)  # never allocated
    with pytest.raises(ValueError):
        pool.free(5)  # out of range
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(ValueError):
        pool.free(row)
    assert pool.available_size() == 2


def test_free_zeroes_the_row_and_clear_resets() -> None:
    pool = ReqToTokenPool(size=2, max_context_len=4)
    row = pool.alloc()
    assert row is not None
    pool.write(row, 0, torch.tensor([5, 6, 7]))
    pool.free(row)
    assert pool.req_to_token[row].eq(0).all()
    pool.alloc()
    pool.clear()
    assert pool.available_size() == 2 and pool.req_to_token.eq(0).all()


def test_write_past_context_len_raises() -> None:
    pool = ReqToTokenPool(size=1, max_context_len=4)
    with pytest.raises(ValueError):
        pool.write(0, 2, torch.tensor([1, 2, 3]))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=4))
def test_written_slots_read_back_per_row(lens: list[list[int]]) -> None:
    """Each request writes its slots in chunks (like chunked prefill + decode); rows don't mix."""
    pool = ReqToTokenPool(size=4, max_context_len=40)
    alloc = TokenToKVPoolAllocator(200, page_size=1)
    expected: dict[int, list[int]] = {}
    for chunks in lens:
        row = pool.alloc()
        assert row is not None and row not in expected
        expected[row] = []
        for n in chunks:
            slots = alloc.alloc(n)
            assert slots is not None
            pool.write(row, len(expected[row]), slots)
            expected[row] += slots.tolist()
    for row, slots in expected.items():
        assert pool.req_to_token[row, : len(slots)].tolist() == slots
        assert pool.req_to_token[row, len(slots) :].eq(0).all()
    assert pool.req_to_token.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_set_kv_buffer_writes_exactly_at_slots(dtype: torch.dtype) -> None:
    kv = KVPool(num_slots=16, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    loc = torch.tensor([3, 9, 1], dtype=torch.int64)
    k = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4) + 1  # nonzero, exact in bf16
    v = -k
    kv.set_kv_buffer(1, loc, k, v)
    k1, v1 = kv.get_kv_buffer(1)
    assert k1.dtype == dtype
    assert torch.equal(k1[loc], k.to(dtype)) and torch.equal(v1[loc], v.to(dtype))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[loc] = False
    assert k1[untouched].eq(0).all() and v1[untouched].eq(0).all()
    # Other layers are separate buffers.
    k0, v0 = kv.get_kv_buffer(0)
    assert k0.eq(0).all() and v0.eq(0).all()


def test_set_kv_buffer_overwrites() -> None:
    kv = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=2)
    loc = torch.tensor([5])
    kv.set_kv_buffer(0, loc, torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    kv.set_kv_buffer(0, loc, torch.full((1, 1, 2), 7.0), torch.full((1, 1, 2), 8.0))
    assert kv.k_buffer[0][5].eq(7).all() and kv.v_buffer[0][5].eq(8).all()


def test_bytes_per_token() -> None:
    # K and V, per layer, per head, per dim, 2 bytes each for bf16.
    assert KVPool.bytes_per_token(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
