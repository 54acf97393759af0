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


def run_then_exit(main: Callable[..., Any], *args: Any) -> None:
    """Run an entry point, flush what it logged and printed, and leave with its status at once. Exceptions
    other than SystemExit (a KeyboardInterrupt, a bug) propagate as usual, with their traceback."""
    try:
        main(*args)
        code = 0
    except SystemExit as e:
        code = exit_code_of(e)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can be said there
    os._exit(code)
