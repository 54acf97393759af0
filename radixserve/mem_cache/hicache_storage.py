"""HiCacheFile: the disk tier under the radix cache, one file per block of KV (SGLang's file backend).

A block is `block_tokens` consecutive positions of one prefix, every layer's K and V of them. Its key
is a hash chain over the tokens from position 0, so a key names the whole prefix up to the block's end
and two prompts share a file exactly when they share that prefix:

    h0 = sha256(identity | namespace)         identity: model files, dtypes, KV dtype, TP/PP layout
    h(i+1) = sha256(h(i) | tokens of block i)  namespace: '' for the base model, the adapter's identity

    DIR/<identity[:24]>/<key[:2]>/<key>.kv      a 512-byte JSON header (magic, identity, key, shape,
                                                dtype, crc32 of the payload), then the payload:
                                                [layers, 2 (K, V), block_tokens, kv_heads, head_dim]

Every entry lives under its identity's folder, and the header repeats the identity: a directory
written by another model, KV dtype, TP layout or adapter gives no hit, never a wrong one. Writes go to
`<key>.<pid>.tmp` and are renamed into place, so a crash mid-write leaves no entry (start-up sweeps the
.tmp debris). A file whose size, header or crc does not match is a miss, one log line, and is deleted.

The scheduler only gathers a block's payload (a copy out of the KV pool, while its slots are still
valid); a writer thread does the file I/O, so eviction never waits on the disk. The index (key -> file
size, least recently used first) lives in memory, rebuilt from the folder at start-up in mtime order;
the total is capped at `capacity_bytes` by deleting the least recently used files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"RSKVBLK1"
HEADER_BYTES = 512  # fixed, so a file's expected size is known from the index alone (a truncated one shows)
FORMAT_VERSION = 1
# Written blocks not yet on disk: past this many bytes a new write is dropped (a miss later), never queued
# without bound, so a burst of evictions cannot grow the process by the size of the disk tier.
MAX_PENDING_BYTES = 512 * 2**20


@dataclass(frozen=True)
class BlockShape:
    """What one block holds: the KV pool's per-token layout times block_tokens."""

    num_layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def file_bytes(self) -> int:
        return len(MAGIC) + HEADER_BYTES + self.payload_bytes


def file_fingerprint(path: str) -> list:
    """A weight file's identity: where it is, its size and mtime, and a hash of its first and last MiB
    (its metadata and tensor table). Another file, or this one rewritten, gives another fingerprint."""
    real = os.path.realpath(path)
    st = os.stat(real)
    h = hashlib.sha256()
    with open(real, "rb") as f:
        h.update(f.read(2**20))
        if st.st_size > 2**21:
            f.seek(st.st_size - 2**20)
            h.update(f.read(2**20))
    return [real, st.st_size, st.st_mtime_ns, h.hexdigest()]


def folder_fingerprint(path: str) -> list:
    """Every weight / config file of a folder (a Hugging Face model or a LoRA adapter)."""
    if os.path.isfile(path):
        return [file_fingerprint(path)]
    names = sorted(n for n in os.listdir(path)
                   if n.endswith((".safetensors", ".bin", ".json", ".gguf", ".model", ".pt")))
    return [[n, *file_fingerprint(os.path.join(path, n))] for n in names]


def identity_of(parts: dict) -> str:
    """The hex identity of a KV layout and the weights that computed it (order-independent JSON)."""
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
                          .encode()).hexdigest()


def chain_keys(identity: str, namespace: str, tokens: Sequence[int], block_tokens: int, num_blocks: int) -> list[str]:
    """Keys of blocks 0 .. num_blocks-1 of `tokens` (the hash chain above); tokens are the 32-bit ids."""
    arr = np.asarray(tokens[: num_blocks * block_tokens], dtype=np.int64) & 0xFFFFFFFF
    raw = arr.astype("<u4").tobytes()
    h = hashlib.sha256(f"{identity}|{namespace}".encode()).digest()
    keys = []
    step = block_tokens * 4
    for i in range(num_blocks):
        h = hashlib.sha256(h + raw[i * step : (i + 1) * step]).digest()
        keys.append(h.hex())
    return keys


@dataclass
class StorageStats:
    """Cumulative counts, reported by get_server_info()['hicache'] and /metrics."""

    hit_tokens: int = 0  # tokens restored from disk into the radix cache
    written_blocks: int = 0
    read_failures: int = 0  # corrupt / truncated / foreign files met on a read (each a miss)
    evicted_blocks: int = 0  # files deleted to stay under the capacity
    dropped_writes: int = 0  # writes skipped: the queue was full, or the disk refused (ENOSPC, EFBIG, ...)


class HiCacheFile:
    """The block store: index, capacity, reads in the caller's thread, writes in a thread of its own."""

    def __init__(self, root: str, identity: str, shape: BlockShape, capacity_bytes: int) -> None:
        self.identity = identity
        self.shape = shape
        self.capacity_bytes = capacity_bytes
        self.folder = os.path.join(root, identity[:24])
        self.stats = StorageStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._bytes = 0
        self._pending: set[str] = set()
        self._pending_bytes = 0
        self._writes_disabled: str | None = None  # why the disk refused a write (a warning, once)
        self._queue: queue.Queue = queue.Queue()
        check_storage_dir(root, shape.file_bytes)
        if capacity_bytes < shape.file_bytes:
            raise ValueError(f"ServerArgs.hicache_size: {capacity_bytes} bytes hold no block of this model's KV "
                             f"({shape.file_bytes} bytes each)")
        os.makedirs(self.folder, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ index
    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key[:2], key + ".kv")

    def _scan(self) -> None:
        """Rebuild the index from the folder: debris of interrupted writes and files of the wrong size are
        deleted (one log line for the lot), the rest enter in mtime order (oldest first = evicted first)."""
        found, bad = [], 0
        for sub in os.listdir(self.folder):
            d = os.path.join(self.folder, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                p = os.path.join(d, name)
                if name.endswith(".tmp"):
                    _unlink(p)
                    bad += 1
                    continue
                if not name.endswith(".kv"):
                    continue
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                if st.st_size != self.shape.file_bytes:
                    _unlink(p)
                    bad += 1
                    continue
                found.append((st.st_mtime_ns, name[:-3], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        if bad:
            logger.warning("hicache: removed %d unfinished or truncated block files in %s", bad, self.folder)
        self._evict_to(self.capacity_bytes)
        logger.info("hicache: %d blocks (%.1f MiB) on disk in %s", len(self._index), self._bytes / 2**20,
                    self.folder)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def contains(self, key: str) -> bool:
        return key in self._index

    def known(self, key: str) -> bool:
        """On disk, or queued to be."""
        with self._lock:
            return key in self._index or key in self._pending

    def _evict_to(self, limit: int) -> None:
        with self._lock:
            while self._bytes > limit and self._index:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                self.stats.evicted_blocks += 1
                _unlink(self._path(key))

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        _unlink(self._path(key))

    # ------------------------------------------------------------------ read
    def read_into(self, key: str, buf: bytearray) -> torch.Tensor | None:
        """Block `key` as a tensor of shape.dims viewing `buf`; None (a miss) when it is absent or fails its
        checks (logged, and the file deleted)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                n = f.readinto(memoryview(buf))
                extra = f.read(1)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            return self._reject(key, f"unreadable ({e})")
        if n != self.shape.file_bytes or extra:
            return self._reject(key, f"{n} bytes, expected {self.shape.file_bytes}")
        why, crc = self._check_header(bytes(buf[: len(MAGIC) + HEADER_BYTES]), key)
        if why is None and zlib.crc32(memoryview(buf)[len(MAGIC) + HEADER_BYTES :]) != crc:
            why = "payload checksum mismatch"
        if why is not None:
            return self._reject(key, why)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        payload = torch.frombuffer(buf, dtype=torch.uint8, offset=len(MAGIC) + HEADER_BYTES)
        return payload.view(self.shape.dtype).view(self.shape.dims)

    def _check_header(self, head: bytes, key: str) -> tuple[str | None, int]:
        """(why the header is not this block's, or None; the payload's crc32 it promises)."""
        if head[: len(MAGIC)] != MAGIC:
            return "not a radixserve KV block", 0
        try:
            meta = json.loads(head[len(MAGIC) :].rstrip(b"\0 ").decode())
        except (UnicodeDecodeError, ValueError):
            return "unreadable header", 0
        if not isinstance(meta, dict) or meta.get("identity") != self.identity or meta.get("key") != key:
            return "written by another model, KV layout or prefix", 0
        if meta.get("dims") != list(self.shape.dims) or meta.get("dtype") != str(self.shape.dtype):
            return f"shape {meta.get('dims')} {meta.get('dtype')} differs from this pool's", 0
        crc = meta.get("crc32")
        if not isinstance(crc, int) or isinstance(crc, bool):
            return "header without a checksum", 0
        return None, crc

    def _reject(self, key: str, why: str) -> None:  # always None: `return self._reject(...)` is a miss
        self.stats.read_failures += 1
        logger.warning("hicache: block %s is %s: a miss (the file is removed)", key[:16], why)
        self._forget(key)

    # ------------------------------------------------------------------ write
    def put(self, key: str, payload: torch.Tensor) -> bool:
        """Queue block `key` (a contiguous tensor of shape.dims the caller no longer touches) for writing.
        True when it is stored or queued now; False when writes are off or the queue is full (dropped)."""
        nbytes = payload.numel() * payload.element_size()
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if self._writes_disabled or self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.stats.dropped_writes += 1
                return False
            self._pending.add(key)
            self._pending_bytes += nbytes
        self._queue.put((key, payload))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, payload = item
                try:
                    self._write(key, payload)
                finally:
                    with self._lock:
                        self._pending.discard(key)
                        self._pending_bytes -= payload.numel() * payload.element_size()
            finally:
                self._queue.task_done()

    def _write(self, key: str, payload: torch.Tensor) -> None:
        raw = payload.contiguous().view(torch.uint8).numpy()
        meta = {"identity": self.identity, "key": key, "dims": list(self.shape.dims),
                "dtype": str(self.shape.dtype), "crc32": zlib.crc32(raw), "time": time.time()}
        head = json.dumps(meta).encode().ljust(HEADER_BYTES, b" ")
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(head)
                f.write(raw.data)
            os.replace(tmp, path)  # atomic: the entry exists whole or not at all
        except OSError as e:
            _unlink(tmp)
            self.stats.dropped_writes += 1
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES):
                with self._lock:
                    self._writes_disabled = str(e)
                logger.warning("hicache: the disk refused a write (%s): no more blocks are written; the ones "
                               "stored are still read", e)
            else:
                logger.warning("hicache: writing block %s failed: %s", key[:16], e)
            return
        with self._lock:
            self._index[key] = self.shape.file_bytes
            self._bytes += self.shape.file_bytes
            self.stats.written_blocks += 1
        self._evict_to(self.capacity_bytes)

    @property
    def writes_disabled(self) -> str | None:
        return self._writes_disabled

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (True), or `timeout` seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def clear(self) -> None:
        """Delete every block of this identity (flush_cache?storage=true); queued writes finish first."""
        self.flush()
        with self._lock:
            self._index.clear()
            self._bytes = 0
        shutil.rmtree(self.folder, ignore_errors=True)
        os.makedirs(self.folder, exist_ok=True)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout=1.0)

    def info(self) -> dict:
        s = self.stats
        return {"storage_blocks": len(self._index), "storage_bytes": self._bytes,
                "storage_capacity_bytes": self.capacity_bytes, "storage_hit_tokens": s.hit_tokens,
                "storage_written_blocks": s.written_blocks, "storage_read_failures": s.read_failures,
                "storage_evicted_blocks": s.evicted_blocks, "storage_dropped_writes": s.dropped_writes}


def check_storage_dir(root: str, block_bytes: int) -> None:
    """Start-up: the directory exists (or is made), is writable and has room for one block; else a
    ValueError naming --hicache-storage-dir (the user asked for a disk tier: serving without one silently
    would hide it)."""
    flag = "ServerArgs.hicache_storage_dir"
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe.{os.getpid()}.tmp")
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag}: {root!r} is not a writable directory ({e.strerror or e})") from None
    free = shutil.disk_usage(root).free
    if free < block_bytes:
        raise ValueError(f"{flag}: {root!r} has {free} bytes free, less than one block of KV ({block_bytes} bytes)")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
