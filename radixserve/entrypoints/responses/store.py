"""ResponseStore: the stored responses (`store: true`), for GET /v1/responses/{id} and previous_response_id.

In memory, bounded: at most --responses-store-size responses, the least recently used (created, read or
continued from) evicted first. A response keeps its own turn only (its input items and its output) and a
reference to the response it continued, so a conversation of k turns costs k turns, not k^2. A chain's
ancestors stay reachable through their descendants after their own ids are evicted (their text is bounded:
each stored conversation fit the context window), while an evicted id itself is a 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    items: list[dict[str, Any]]  # this turn's input items (instructions are not carried over, as OpenAI's)
    parent: StoredResponse | None = None  # the response this one continued (previous_response_id)

    def conversation(self) -> list[dict[str, Any]]:
        """Every turn's input items and output items, oldest first (what a continuation prepends)."""
        chain: list[StoredResponse] = []
        node: StoredResponse | None = self
        while node is not None:  # a loop, not recursion: a chain may be long
            chain.append(node)
            node = node.parent
        items: list[dict[str, Any]] = []
        for node in reversed(chain):
            items.extend(node.items)
            items.extend(node.body["output"])
        return items


class ResponseStore:
    """An LRU map id -> StoredResponse with a size cap (one asyncio loop uses it: no lock)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"responses_store_size: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None when unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
