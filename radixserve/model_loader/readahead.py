"""Start reading the model file into the page cache as the scheduler process starts (a cold start).

The scheduler spends its first ~1.5 s importing torch and the model stack before it reads a weight. With a cold
page cache the weights then come in as the repack faults on them, one readahead window at a time. A
`POSIX_FADV_WILLNEED` at process start, on a thread, has the disk reading while the imports run. The page cache
is the kernel's: a warm start, or a second rank on the same file, costs nothing. A file larger than half of the
available memory is left alone: reading it all in would push out pages someone else needs, and the repack reads it
in order anyway.
"""

from __future__ import annotations

import os
import threading

from radixserve.model_executor.memory_budget import available_memory


def start_readahead(path: str) -> threading.Thread | None:
    """A daemon thread advising the kernel to read `path` in; None where there is nothing to do (a folder, a
    missing file, one too large to read ahead)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > available_memory() // 2:
            return None
    except OSError:
        return None
    thread = threading.Thread(target=_will_need, args=(path,), name="rs-readahead", daemon=True)
    thread.start()
    return thread


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
