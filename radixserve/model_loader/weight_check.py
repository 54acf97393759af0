"""Naming and checking the weight cache's files without torch (model_loader/weight_cache.py writes and maps them).

A mapped file is trusted only after a digest of every byte matches the one its index recorded. Over an 8B model's
4.6 GB that is ~0.3 s of one core, so the scheduler process starts it on a thread first thing
(model_loader/readahead.py), where it runs beside the ~1.5 s the process spends importing torch on the other core;
the load then takes its result if the file it maps is the one that was checked (same inode, size and mtime),
and computes it itself otherwise.

The digest: SHA-256 over the length and the 64-bit wrapping sum of each 64 KiB (numpy, one pass at memory speed).
Any changed, zeroed or missing byte changes its chunk's sum; it is a check against damage, not against an
adversary who can write the cache folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import threading

import numpy as np

INDEX_VERSION = 1
CHUNK = 1 << 16  # bytes summed together
_SLICE = CHUNK * 1024  # bytes per numpy call: few calls, so the thread barely holds the GIL
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the code that decides the packed bytes: any edit to it makes every older file a miss
LAYOUT_SOURCES = ("layers/quantization/qweight.py", "layers/quantization/plan.py",
                  "layers/quantization/gguf_formats.py", "layers/quantization/scale_factors.py",
                  "layers/quantization/expert_slab.py", "kernels/cpu/csrc/repack.cpp", "model_loader/weight_cache.py",
                  "model_loader/weight_check.py")

FileKey = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


@functools.lru_cache(maxsize=1)
def layout_fingerprint() -> str:
    digest = hashlib.sha256()
    for rel in LAYOUT_SOURCES:
        with open(os.path.join(_ROOT, rel), "rb") as fh:
            digest.update(rel.encode() + b"\0" + fh.read())
    return digest.hexdigest()[:16]


def weight_tag(mode: str, sizes: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    """`<layout>-<ranks>`: the layout (mode, the replica's tp / pp / ep sizes, the code) shared by its ranks' files,
    then this rank's tp / pp indices."""
    layout = json.dumps([INDEX_VERSION, mode, list(sizes), layout_fingerprint()])
    return hashlib.sha256(layout.encode()).hexdigest()[:16] + "-" + "-".join(map(str, ranks))


def digest(buf: object) -> str:
    """The digest of a bytes-like object (a mapped file)."""
    data = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
    whole = data.size // CHUNK * CHUNK
    h = hashlib.sha256(data.size.to_bytes(8, "little"))
    for start in range(0, whole, _SLICE):
        rows = data[start: min(whole, start + _SLICE)].view(np.uint64).reshape(-1, CHUNK // 8)
        h.update(np.add.reduce(rows, axis=1, dtype=np.uint64).tobytes())
    h.update(data[whole:].tobytes())
    return h.hexdigest()


def file_key(fd: int) -> FileKey:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def file_digest(path: str) -> tuple[FileKey, str] | None:
    """(the file's identity, its digest); None if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            key = file_key(fh.fileno())
            if key[2] == 0:
                return key, digest(b"")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return key, digest(view)
                finally:
                    view.release()
    except (OSError, ValueError):
        return None


class _Precheck:
    def __init__(self, path: str) -> None:
        self.result: tuple[FileKey, str] | None = None
        self.thread = threading.Thread(target=self._run, args=(path,), name="rs-weight-check", daemon=True)

    def _run(self, path: str) -> None:
        self.result = file_digest(path)


_PRECHECKS: dict[str, _Precheck] = {}
_LOCK = threading.Lock()


def start_precheck(path: str) -> threading.Thread | None:
    """Digest `path` on a daemon thread, for checked_digest; None where it does not exist."""
    if not os.path.isfile(path):
        return None
    check = _Precheck(path)
    with _LOCK:
        _PRECHECKS[path] = check
    check.thread.start()
    return check.thread


def checked_digest(path: str, key: FileKey, buf: object) -> str:
    """The digest of `buf`, the mapped file at `path` whose identity is `key`: the precheck's result where it
    checked this very file, else computed now."""
    with _LOCK:
        check = _PRECHECKS.pop(path, None)
    if check is not None:
        check.thread.join()
        if check.result is not None and check.result[0] == key:
            return check.result[1]
    return digest(buf)
