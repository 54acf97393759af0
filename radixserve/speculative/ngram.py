"""NgramIndex and NgramProposer: prompt-lookup drafts from one request's own tokens (prompt + output).

Editing, summarising, extraction and code often repeat spans of their context. If the last w tokens
(min_window <= w <= max_window, longest first) occurred earlier, the tokens that followed that
earlier occurrence are a cheap guess for what comes next: the draft. The index maps every n-gram of
each window length to the position right after its most recent earlier occurrence; it is updated
incrementally as tokens arrive (O(max_window) per token), so proposing costs a dict lookup per
window length, never a scan of the context. A lookup is deterministic: a point-mass proposal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.speculative.proposer import DraftProposer
from radixserve.speculative.spec_info import Draft

if TYPE_CHECKING:
    from radixserve.managers.req import Req


class NgramIndex:
    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.tokens: list[int] = []
        # (window length, n-gram) -> end position (exclusive) of its latest occurrence, excluding the
        # current suffix; `_pending` holds the suffix n-grams, committed when the next token arrives
        self.last_end: dict[tuple[int, ...], int] = {}
        self._pending: list[tuple[tuple[int, ...], int]] = []

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            for key, end in self._pending:  # the previous suffixes now have a following token
                self.last_end[key] = end
            self.tokens.append(t)
            n = len(self.tokens)
            self._pending = [(tuple(self.tokens[n - w :]), n) for w in range(self.min_window, self.max_window + 1)
                             if w <= n]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the current suffix."""
        n = len(self.tokens)
        if k <= 0:
            return []
        for w in range(min(self.max_window, n), self.min_window - 1, -1):
            end = self.last_end.get(tuple(self.tokens[n - w :]))
            if end is not None and end < n:
                return self.tokens[end : end + k]
        return []


class NgramProposer(DraftProposer):
    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window, self.max_window = min_window, max_window

    def _index(self, req: Req) -> NgramIndex:
        idx = req.spec_state
        if idx is None:
            idx = req.spec_state = NgramIndex(self.min_window, self.max_window)
        seen, n_in = len(idx.tokens), len(req.origin_input_ids)
        if seen < n_in:  # first time: the prompt (slices of what is new only, never a concatenation)
            idx.extend(req.origin_input_ids[seen:])
        idx.extend(req.output_ids[max(0, seen - n_in):])
        return idx

    def propose(self, reqs: list[Req], lens: list[int]) -> list[Draft]:
        return [Draft(_before_image(self._index(r).propose(k), r)) if k > 0 else Draft() for r, k in zip(reqs, lens)]


def _before_image(tokens: list[int], req: Req) -> list[int]:
    """A draft copied from the prompt ends where an image span begins: a pad id is not a token the model can
    emit (multimodal/mm_inputs.py)."""
    if req.mm_inputs is None:
        return tokens
    cut = next((i for i, t in enumerate(tokens) if t >= req.vocab_size), len(tokens))
    return tokens[:cut]
