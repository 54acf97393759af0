"""Radix cache namespaces: one tree serves the base model and every LoRA adapter, without sharing.

The KV of a token depends on the adapter that computed it, so a prefix computed under adapter A must
never be matched by adapter B or by the base model. Each adapter registration gets a uid (never reused,
lora/lora_manager.py); its requests' keys are their token ids shifted by uid << 32 (token ids are < 2**32),
so keys of different namespaces never compare equal and the tree, its LRU and its accounting stay one.

    base (uid 0):   [ 12  7  99 ]              adapter uid 3:   [ 3<<32|12  3<<32|7  3<<32|99 ]
"""

from __future__ import annotations

NAMESPACE_SHIFT = 32


def namespaced(token_ids: list[int], namespace: int) -> list[int]:
    if namespace == 0:
        return token_ids
    base = namespace << NAMESPACE_SHIFT
    return [base | t for t in token_ids]


def token_of(key_id: int) -> int:
    """The token id inside a namespaced key id (for views of the tree)."""
    return key_id & ((1 << NAMESPACE_SHIFT) - 1)
