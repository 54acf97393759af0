"""radix_tree_json: the tree the web page shows, bounded in nodes and depth, breadth first."""

from __future__ import annotations

import pytest

from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.radix_tree_view import PREVIEW_TOKENS, radix_tree_json
from tests.mem_cache.test_radix_cache import make, put

SHARED = list(range(100, 130))  # a 30-token "system prompt"


def _tree(ps: int = 1):
    _, alloc, cache = make(ps, num_pages=256 // ps)
    put(cache, alloc, SHARED + [1, 2, 3, 4])
    put(cache, alloc, SHARED + [7, 8])
    put(cache, alloc, [50] * 8)
    return alloc, cache


def test_shared_prefix_is_one_node_with_two_children() -> None:
    _, cache = _tree()
    tree = radix_tree_json(cache, max_nodes=100, max_depth=10)
    assert tree["enabled"] and not tree["truncated"] and tree["total_tokens"] == 30 + 4 + 2 + 8
    by_id = {n["id"]: n for n in tree["nodes"]}
    assert len(by_id) == 4
    shared = next(n for n in tree["nodes"] if n["num_tokens"] == 30)
    assert shared["parent"] == 0 and shared["num_children"] == 2 and shared["depth"] == 1
    assert shared["preview_ids"] == SHARED[:PREVIEW_TOKENS]  # bounded preview of a long edge
    kids = [n for n in tree["nodes"] if n["parent"] == shared["id"]]
    assert sorted(n["num_tokens"] for n in kids) == [2, 4]
    assert all(n["prefix_len"] == 30 + n["num_tokens"] and n["depth"] == 2 for n in kids)
    # most recently used first among siblings: [7, 8] was inserted after [1, 2, 3, 4]
    assert kids[0]["preview_ids"] == [7, 8]
    # breadth first: every depth-1 node comes before any depth-2 node
    depths = [n["depth"] for n in tree["nodes"]]
    assert depths == sorted(depths)


def test_locks_show_and_sizes_add_up() -> None:
    _, cache = _tree()
    leaf = cache.match_prefix(SHARED + [1, 2, 3, 4]).last_node
    cache.inc_lock_ref(leaf)
    tree = radix_tree_json(cache, max_nodes=100, max_depth=10)
    locked = {n["num_tokens"]: n["lock_ref"] for n in tree["nodes"]}
    assert locked == {30: 1, 4: 1, 2: 0, 8: 0}
    assert tree["locked_tokens"] == 34 and tree["evictable_tokens"] == 10
    assert tree["locked_tokens"] + tree["evictable_tokens"] == tree["total_tokens"]
    cache.dec_lock_ref(leaf)


def test_bounds_cut_the_tree_and_say_so() -> None:
    _, cache = _tree()
    one = radix_tree_json(cache, max_nodes=1, max_depth=10)
    assert len(one["nodes"]) == 1 and one["truncated"] and one["root_children"] == 2
    top = radix_tree_json(cache, max_nodes=100, max_depth=1)
    assert [n["depth"] for n in top["nodes"]] == [1, 1] and top["truncated"]
    shared = next(n for n in top["nodes"] if n["num_tokens"] == 30)
    assert shared["num_children"] == 2 and shared["children_cut"] == 2


def test_a_wide_tree_is_bounded() -> None:
    _, alloc, cache = make(1, num_pages=4096)
    for i in range(1000):
        put(cache, alloc, [i, i + 1, i + 2])
    tree = radix_tree_json(cache, max_nodes=50, max_depth=32)
    assert len(tree["nodes"]) == 50 and tree["truncated"] and tree["root_children"] == 1000


@pytest.mark.parametrize("ps", [4])
def test_pages(ps: int) -> None:
    _, alloc, cache = make(ps, num_pages=64)
    put(cache, alloc, list(range(8)) + [9, 9, 9, 9])
    put(cache, alloc, list(range(8)) + [5, 5, 5, 5])
    tree = radix_tree_json(cache, max_nodes=10, max_depth=10)
    assert tree["page_size"] == 4 and [n["num_tokens"] for n in tree["nodes"]] == [8, 4, 4]


def test_without_the_radix_cache_there_is_no_tree() -> None:
    _, _, cache = make(1, cls=ChunkCache)
    tree = radix_tree_json(cache, max_nodes=10, max_depth=10)
    assert tree["enabled"] is False and tree["nodes"] == []
