"""How a radixserve process that is done leaves: without the interpreter's finalisation.

A scheduler or server process that has stopped cleanly (its disk tier closed, its children stopped, its last
line printed) has nothing left for Python to tear down that the kernel does not reclaim by itself: freeing
torch's modules, the model's tensors and the mapped weights took ~0.4 s of each process's exit on a 2-vCPU
Zen 3, so a server stopped ~1.1 s after SIGTERM where it now stops in ~0.3 s. Only a process's own entry
point calls this, never a library function: an Engine in a user's interpreter exits as that interpreter does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any


def exit_code_of(exc: SystemExit) -> int:
    """The status a SystemExit would give; its message, if it carries one, goes to stderr as Python prints it."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_BEFORE_EXIT: list[Callable[[], None]] = []


def before_exit(hook: Callable[[], None]) -> None:
    """Run `hook` when run_then_exit leaves (once, whatever it was given first): what a thread has half-done on
    disk, it undoes there (model_loader/weight_cache.py: a cache write's temporary file). atexit would never
    run: the process leaves by os._exit."""
    if hook not in _BEFORE_EXIT:
        _BEFORE_EXIT.append(hook)


def run_then_exit(main: Callable[..., Any], *args: Any) -> None:
    """Run an entry point, flush what it logged and printed, and leave with its status at once. Exceptions
    other than SystemExit (a KeyboardInterrupt, a bug) propagate as usual, with their traceback."""
    try:
        main(*args)
        code = 0
    except SystemExit as e:
        code = exit_code_of(e)
    for hook in _BEFORE_EXIT:
        try:
            hook()
        except Exception:  # a hook's failure must not change how the process leaves
            logging.getLogger(__name__).exception("a before-exit hook failed")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can be said there
    os._exit(code)
