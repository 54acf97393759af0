"""Start reading the model file into the page cache as the scheduler process starts (a cold start).

The scheduler spends its first ~1.5 s importing torch and the model stack before it reads a weight. With a cold
page cache the weights then come in as the repack faults on them, one readahead window at a time. A
`POSIX_FADV_WILLNEED` at process start, on a thread, has the disk reading while the imports run. The page cache
is the kernel's: a warm start, or a second rank on the same file, costs nothing. A file larger than half of the
available memory is left alone: reading it all in would push out pages someone else needs, and the repack reads it
in order anyway. With a weight cache (model_loader/weight_cache.py) its files are read instead.
"""

from __future__ import annotations

import os
import threading

from radixserve.model_executor.memory_budget import available_memory
from radixserve.model_loader.gguf_cache import WEIGHTS_PREFIX, CacheEntry, cache_entry, weight_files
from radixserve.model_loader.weight_check import start_precheck


def start_readahead(path: str, weight_cache: bool = True, weight_tag: str | None = None) -> threading.Thread | None:
    """A daemon thread advising the kernel to read `path` in (or, where an earlier start left packed layers in the
    weight cache, those files: the load maps them and reads little else of the model file); None where there is
    nothing to do (a folder, a missing file, files too large to read ahead). `weight_tag`: this rank's weight
    cache file (weight_check.weight_tag), whose digest another thread computes at once for the load."""
    try:
        if not os.path.isfile(path):
            return None
        entry = cache_entry(path) if weight_cache else None
        if entry is not None and weight_tag is not None:
            start_precheck(entry.file(f"{WEIGHTS_PREFIX}{weight_tag}.bin"))
        files = files_to_read(path, entry)
        if sum(os.path.getsize(f) for f in files) > available_memory() // 2:
            return None
    except OSError:
        return None
    thread = threading.Thread(target=_will_need_all, args=(files,), name="rs-readahead", daemon=True)
    thread.start()
    return thread


def files_to_read(path: str, entry: CacheEntry | None) -> list[str]:
    """The weight cache's files in the model's cache `entry` where an earlier start wrote them, else the model."""
    return (weight_files(entry) if entry is not None else []) or [path]


def _will_need_all(paths: list[str]) -> None:
    for p in paths:
        _will_need(p)


def _will_need(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the loader reports an unreadable file, by its name
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advice only: a filesystem without readahead is read as it is faulted in
    finally:
        os.close(fd)
