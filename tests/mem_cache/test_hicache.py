"""The disk tier under the radix cache (--enable-hierarchical-cache): in-process schedulers on the real default
model, sharing one directory the way a restarted server does.

What a restart keeps, what eviction writes back, and that a truncated, corrupt, foreign or half-written file is a
miss (one log line), never wrong tokens. The real-process restart (SIGTERM, kill -9) is in
tests/entrypoints/test_http_hicache.py.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from radixserve.mem_cache.hicache_storage import HEADER_BYTES, MAGIC, BlockShape, HiCacheFile
from tests.managers.driver import compare, greedy, run

PROMPTS = {"a": list(range(1000, 1300)), "b": list(range(2000, 2150))}  # 300 and 150 tokens


@pytest.fixture
def hicache(make_scheduler, tmp_path):
    """make(**overrides) -> a Scheduler with the disk tier in tmp_path/hc (the same folder every call)."""
    made = []

    def make(**overrides):
        overrides.setdefault("enable_hierarchical_cache", True)
        overrides.setdefault("hicache_storage_dir", str(tmp_path / "hc"))
        sched = make_scheduler(**overrides)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.tree_cache.storage.close(5.0)  # the writer thread of each


def cached(results) -> dict[str, int]:
    return {rid: r.meta["cached_tokens"] for rid, r in results.items()}


def block_files(tmp_path) -> list[str]:
    return sorted(glob.glob(str(tmp_path / "hc" / "*" / "*" / "*.kv")))


def test_a_restarted_scheduler_hits_what_the_first_one_saved(hicache, tmp_path):
    first = hicache()
    ref = run(first, PROMPTS, greedy(8))
    assert cached(ref) == {"a": 0, "b": 0}
    first.tree_cache.close()  # what a stopping server does: every unsaved node is written
    # 300 + 7 computed positions: 4 whole blocks of 64; 150 + 7: 2 blocks
    assert len(block_files(tmp_path)) == 6

    again = hicache()
    got = run(again, PROMPTS, greedy(8))
    assert cached(got) == {"a": 256, "b": 128}
    assert compare(ref, got) == 0  # the restored KV is the computed KV, bit for bit
    info = again.get_server_info()["hicache"]
    assert info["storage_hit_tokens"] == 384 and info["storage_read_failures"] == 0
    # a second match is a memory hit: nothing more is read from disk
    run(again, {"a2": PROMPTS["a"]}, greedy(2))
    assert again.get_server_info()["hicache"]["storage_hit_tokens"] == 384


def test_eviction_writes_back_and_a_later_match_reads_it(hicache):
    """A pool of ~700 tokens: the second and third prompts evict the first from memory; its blocks were written
    on the way out and come back from disk, with the same greedy tokens."""
    sched = hicache(max_total_tokens=720)
    prompts = {f"p{i}": list(range(3000 + 500 * i, 3000 + 500 * i + 320)) for i in range(3)}
    ref = run(sched, {"p0": prompts["p0"]}, greedy(6))
    run(sched, {"p1": prompts["p1"]}, greedy(6))
    run(sched, {"p2": prompts["p2"]}, greedy(6))
    info = sched.get_server_info()["hicache"]
    assert info["memory_evicted_tokens"] > 0 and info["storage_written_blocks"] >= 5
    sched.tree_cache.storage.flush()
    again = run(sched, {"p0": prompts["p0"]}, greedy(6))
    assert again["p0"].meta["cached_tokens"] == 256  # whole blocks of the prompt less its last token
    assert compare(ref, again) == 0
    assert sched.get_server_info()["hicache"]["storage_hit_tokens"] >= 256


def test_twice_reused_prefixes_are_written_through(hicache):
    """write-through-selective: a prefix is written once admissions reused it twice, with no eviction."""
    sched = hicache()
    system = list(range(5000, 5200))
    run(sched, {"u0": system + [7, 8, 9]}, greedy(2))
    run(sched, {"u1": system + [10, 11]}, greedy(2))
    sched.tree_cache.storage.flush()
    assert sched.get_server_info()["hicache"]["storage_written_blocks"] == 0  # one reuse: not yet
    run(sched, {"u2": system + [12, 13]}, greedy(2))
    sched.tree_cache.storage.flush()
    assert sched.get_server_info()["hicache"]["storage_written_blocks"] == 3  # 200 shared tokens: 3 blocks


def test_bad_files_are_misses_never_wrong_tokens(hicache, tmp_path, caplog):
    first = hicache()
    ref = run(first, {"a": PROMPTS["a"]}, greedy(8))
    first.tree_cache.close()
    files = block_files(tmp_path)
    assert len(files) == 4
    store = first.tree_cache.storage
    from radixserve.mem_cache.hicache_storage import chain_keys

    keys = chain_keys(store.identity, "", PROMPTS["a"], 64, 4)
    by_key = {os.path.basename(f)[:-3]: f for f in files}
    # block 3 (positions 192..255): a flipped payload byte -> the crc says no
    with open(by_key[keys[3]], "r+b") as f:
        f.seek(len(MAGIC) + HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    # block 2: a header that lies (another model's identity), at the right size
    with open(by_key[keys[2]], "r+b") as f:
        f.seek(len(MAGIC))
        head = json.loads(f.read(HEADER_BYTES).rstrip(b" \0"))
        head["identity"] = "0" * 64
        f.seek(len(MAGIC))
        f.write(json.dumps(head).encode().ljust(HEADER_BYTES, b" "))
    # debris of a write killed half-way, next to the entries
    with open(by_key[keys[1]] + ".999.tmp", "wb") as f:
        f.write(b"half")

    caplog.set_level(logging.WARNING, logger="radixserve.mem_cache.hicache_storage")
    again = hicache()
    assert not glob.glob(str(tmp_path / "hc" / "*" / "*" / "*.tmp"))  # swept at start-up
    got = run(again, {"a": PROMPTS["a"]}, greedy(8))
    assert got["a"].meta["cached_tokens"] == 128  # blocks 0 and 1; block 2 fails, so block 3 is never read
    assert compare(ref, got) == 0
    assert again.get_server_info()["hicache"]["storage_read_failures"] == 1
    assert "written by another model" in caplog.text
    assert not os.path.exists(by_key[keys[2]])  # a bad entry is removed
    # a truncated file is dropped by the start-up scan (its size is wrong), with one log line
    with open(by_key[keys[1]], "r+b") as f:
        f.truncate(1000)
    caplog.clear()
    third = hicache()
    assert "truncated" in caplog.text
    got3 = run(third, {"a": PROMPTS["a"]}, greedy(8))
    assert got3["a"].meta["cached_tokens"] == 64 and compare(ref, got3) == 0


def test_another_kv_dtype_or_model_never_hits(hicache, tmp_path, make_scheduler):
    first = hicache()
    run(first, PROMPTS, greedy(4))
    first.tree_cache.close()
    other = hicache(kv_cache_dtype="bfloat16")  # same directory, another KV layout
    got = run(other, PROMPTS, greedy(4))
    assert cached(got) == {"a": 0, "b": 0}
    assert other.get_server_info()["hicache"]["storage_read_failures"] == 0  # not even opened: another folder


def test_the_disk_tier_stays_under_its_size(hicache, tmp_path):
    with pytest.raises(ValueError, match="hicache_size: 107374 bytes hold no block"):
        hicache(hicache_size=0.0001)  # ~107 KB: less than one block of this model (2.9 MB)
    sched = hicache()
    shape_bytes = sched.tree_cache.storage.shape.file_bytes
    sched2 = hicache(hicache_size=3 * shape_bytes / 2**30)  # room for 3 blocks
    run(sched2, PROMPTS, greedy(4))
    sched2.tree_cache.close()
    info = sched2.get_server_info()["hicache"]
    assert info["storage_blocks"] == 3 and info["storage_bytes"] <= 3 * shape_bytes
    assert info["storage_evicted_blocks"] == 3 and len(block_files(tmp_path)) == 3


def test_flush_cache_empties_the_disk_only_when_asked(hicache, tmp_path):
    sched = hicache()
    run(sched, PROMPTS, greedy(4))
    sched.tree_cache.close()
    assert sched.flush_cache() and len(block_files(tmp_path)) == 6
    got = run(sched, {"a": PROMPTS["a"]}, greedy(4))
    assert got["a"].meta["cached_tokens"] == 256  # the memory tier was emptied; the disk gave it back
    assert sched.flush_cache(storage=True)
    assert block_files(tmp_path) == [] and sched.get_server_info()["hicache"]["storage_blocks"] == 0
    got = run(sched, {"a": PROMPTS["a"]}, greedy(4))
    assert got["a"].meta["cached_tokens"] == 0


def test_an_unwritable_directory_is_a_start_up_error(make_scheduler, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="hicache_storage_dir.*not a writable directory"):
        make_scheduler(enable_hierarchical_cache=True, hicache_storage_dir=str(blocker / "hc"))


def test_a_disk_that_fills_up_stops_the_writes_not_the_reads(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 100 KB (EFBIG, what ENOSPC looks like to the writer):
    the first block fails, writes stop with one warning, and the blocks already stored still read."""
    code = f"""
import logging, resource, torch
logging.basicConfig(level=logging.WARNING)
from radixserve.mem_cache.hicache_storage import BlockShape, HiCacheFile
shape = BlockShape(2, 64, 2, 16, torch.float32)  # 32 KiB blocks
store = HiCacheFile({str(tmp_path)!r}, "f" * 64, shape, 2**30)
data = torch.randn(shape.dims)
assert store.put("a" * 64, data) and store.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (shape.file_bytes // 2, resource.RLIM_INFINITY))
store.put("b" * 64, torch.randn(shape.dims)); store.flush()
assert store.writes_disabled, "the refused write must switch writes off"
assert not store.put("c" * 64, torch.randn(shape.dims))
buf = bytearray(shape.file_bytes)
assert torch.equal(store.read_into("a" * 64, buf), data)
assert store.read_into("b" * 64, buf) is None
print("OK", store.info()["storage_dropped_writes"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK 2"
    assert "the disk refused a write" in out.stderr


def test_a_block_file_round_trips_and_refuses_another_shape(tmp_path):
    shape = BlockShape(3, 64, 2, 8, torch.bfloat16)
    store = HiCacheFile(str(tmp_path), "e" * 64, shape, 2**30)
    data = torch.randn(shape.dims).to(torch.bfloat16)
    store.put("k" * 64, data)
    store.flush()
    buf = bytearray(shape.file_bytes)
    assert torch.equal(store.read_into("k" * 64, buf), data)
    store.close()
    # the same folder opened for another layout: its files have the wrong size, so the scan drops them
    other = HiCacheFile(str(tmp_path), "e" * 64, BlockShape(3, 64, 2, 8, torch.float32), 2**30)
    assert len(other) == 0
    other.close()


def test_a_restore_that_evicts_does_not_strand_an_earlier_match(hicache, make_scheduler):
    """Two requests wait together: A's prefix is in memory (unlocked until admitted), B's on disk, and the pool
    can take B's blocks only by evicting A's prefix. The queue is matched again after such a restore, so A never
    runs on freed slots (--check-invariants would catch a slot with two owners), and both answer as alone."""
    p0 = list(range(6000, 6640))  # 640 tokens: 9 blocks of the 639 a match can take
    p1 = list(range(7000, 7320))
    a_prompt, b_prompt = p1 + list(range(100, 110)), p0
    alone = run(make_scheduler(), {"A": a_prompt, "B": b_prompt}, greedy(4))
    sched = hicache(max_total_tokens=800)
    run(sched, {"B0": p0}, greedy(4))
    sched.tree_cache.close()  # p0 on disk
    assert sched.flush_cache()  # ... and only there
    run(sched, {"A0": p1}, greedy(4))  # p1 in memory, evictable
    both = run(sched, {"A": a_prompt, "B": b_prompt}, greedy(4))
    assert both["B"].meta["cached_tokens"] == 576
    assert compare(alone, both) == 0


def test_pages_of_48_and_chunked_prefill_restore_whole_blocks(hicache, tmp_path):
    """page_size 48: blocks are rounded up to 96 positions (whole pages); prompts cut in 100-token chunks."""
    first = hicache(page_size=48, chunked_prefill_size=100)
    assert first.tree_cache.block == 96
    ref = run(first, PROMPTS, greedy(6))
    first.tree_cache.close()
    again = hicache(page_size=48, chunked_prefill_size=100)
    got = run(again, PROMPTS, greedy(6))
    assert cached(got) == {"a": 288, "b": 96}
    assert compare(ref, got) == 0


@pytest.mark.parametrize("kw, field", [
    ({"enable_hierarchical_cache": True}, "hicache_storage_dir"),
    ({"hicache_storage_dir": "/tmp/x"}, "hicache_storage_dir"),
    ({"enable_hierarchical_cache": True, "hicache_storage_dir": "/tmp/x", "disable_radix_cache": True},
     "enable_hierarchical_cache"),
    ({"hicache_size": -1}, "hicache_size"), ({"hicache_size": 0}, "hicache_size"),
    ({"hicache_size": 1e12}, "hicache_size"), ({"hicache_size": float("nan")}, "hicache_size"),
    ({"hicache_size": True}, "hicache_size"), ({"hicache_size": "16"}, "hicache_size"),
])
def test_absurd_disk_tier_knobs_are_refused_naming_them(kw, field):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
        ServerArgs(**kw)


def test_an_int8_pool_stores_and_restores_its_q8_0_rows(hicache, tmp_path):
    """--kv-cache-dtype int8: the blocks hold the pool's q8_0 rows as they are (34 bytes per 32 values), and the
    KV dtype is part of the folder's identity: a bf16 server sharing the directory never reads them."""
    first = hicache(kv_cache_dtype="int8")
    ref = run(first, PROMPTS, greedy(8))
    first.tree_cache.close()
    files = block_files(tmp_path)
    pool = first.model_runner.token_to_kv_pool
    assert len(files) == 6 and pool.row_width == pool.head_dim // 32 * 34
    assert os.path.getsize(files[0]) == first.tree_cache.storage.shape.file_bytes
    assert first.tree_cache.storage.shape.payload_bytes == pool.num_layers * 2 * 64 * pool.num_kv_heads * pool.row_width
    again = hicache(kv_cache_dtype="int8")
    got = run(again, PROMPTS, greedy(8))
    assert cached(got) == {"a": 256, "b": 128} and compare(ref, got) == 0
    other = hicache(kv_cache_dtype="bfloat16")
    assert cached(run(other, PROMPTS, greedy(2))) == {"a": 0, "b": 0}
