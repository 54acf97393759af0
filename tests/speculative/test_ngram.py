"""NgramIndex: every draft continues an earlier occurrence of the current suffix, the longest window
wins, and the index built incrementally answers like a scan of the whole context."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.speculative.ngram import NgramIndex


def _scan(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    n = len(tokens)
    for w in range(min(hi, n), lo - 1, -1):
        suffix = tokens[n - w :]
        for end in range(n - 1, w - 1, -1):  # latest earlier occurrence ending before n
            if tokens[end - w : end] == suffix:
                return tokens[end : end + k]
    return []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=60), lo=st.integers(1, 3), extra=st.integers(0, 4),
       k=st.integers(0, 5), split=st.integers(0, 60))
def test_incremental_index_equals_a_full_scan(tokens, lo, extra, k, split) -> None:
    idx = NgramIndex(lo, lo + extra)
    idx.extend(tokens[:split])
    idx.extend(tokens[split:])
    assert idx.propose(k) == _scan(tokens, lo, lo + extra, k)


def test_longest_match_wins_and_empty_contexts_propose_nothing() -> None:
    idx = NgramIndex(1, 4)
    assert idx.propose(3) == []
    idx.extend([1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0..2 (followed by 9 9 2), [2, 3] last at 5..6 (followed by 7)
    assert idx.propose(3) == [9, 9, 2]
    assert idx.propose(0) == []
    idx.extend([4])
    assert idx.propose(2) == []  # 4 never occurred before
