"""The radix tree as bounded JSON, for the web page's tree view (GET /debug/radix_tree).

    root                                     nodes (breadth first, most recently used child first):
     |-- [sys prompt: 40 tokens]   lock 1    {"id": 7, "parent": 0, "depth": 1, "num_tokens": 40,
     |      |-- [question A: 9]    lock 1     "prefix_len": 40, "lock_ref": 1, "last_access": 12,
     |      `-- [question B: 11]   lock 0     "num_children": 2, "preview_ids": [...]}, ...
     `-- [other prompt: 25]        lock 0

Breadth first so that a cut keeps the shared prefixes near the root (the interesting part); at most
`max_nodes` nodes and `max_depth` levels, and a node whose children were cut says how many
(`num_children` counts all of them, `children_cut` the ones left out). Token ids, not text: the HTTP
process decodes the previews, so the scheduler only walks the tree. The walk touches no LRU time and
takes no lock, and it runs between steps (the scheduler is single threaded), so it sees a consistent tree.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.cache_namespace import token_of
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode

PREVIEW_TOKENS = 24  # token ids of each edge sent for its text preview


def radix_tree_json(cache: BasePrefixCache, max_nodes: int, max_depth: int,
                    preview_tokens: int = PREVIEW_TOKENS) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "enabled": isinstance(cache, RadixCache),
        "page_size": cache.page_size,
        "total_tokens": cache.total_size(),
        "evictable_tokens": cache.evictable_size(),
        "locked_tokens": cache.protected_size(),
        "nodes": [],
        "truncated": False,
    }
    if not isinstance(cache, RadixCache):
        return summary  # --disable-radix-cache: nothing is shared, there is no tree
    summary["clock"] = cache._clock  # the tree's logical LRU clock: last_access is a tick of it
    nodes: list[dict[str, Any]] = summary["nodes"]
    # (node, its id in the output, depth, prefix length above it)
    queue: deque[tuple[TreeNode, int, int, int]] = deque([(cache.root, 0, 0, 0)])
    while queue:
        node, node_id, depth, prefix_len = queue.popleft()
        children = sorted(node.children.values(), key=lambda c: (-c.last_access, c.id))
        room = max_nodes - len(nodes)
        if depth >= max_depth:
            room = 0
        kept = children[: max(0, room)]
        if node_id != 0:
            nodes[node_id - 1]["children_cut"] = len(children) - len(kept)
        if len(kept) < len(children):
            summary["truncated"] = True
        for child in kept:
            nodes.append({
                "id": len(nodes) + 1,  # 0 is the root; ids are positions in this answer, not TreeNode ids
                "parent": node_id,
                "depth": depth + 1,
                "num_tokens": len(child.key),
                "prefix_len": prefix_len + len(child.key),
                "lock_ref": child.lock_ref,
                "last_access": child.last_access,
                "num_children": len(child.children),
                "children_cut": 0,
                "preview_ids": [token_of(t) for t in child.key[:preview_tokens]],  # without the LoRA namespace
            })
            queue.append((child, len(nodes), depth + 1, prefix_len + len(child.key)))
    summary["root_children"] = len(cache.root.children)
    return summary
