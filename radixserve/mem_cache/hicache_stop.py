"""How long a stopping server gives its scheduler when the disk tier saves on the way out.

Apart from hiradix_cache.py (which imports torch) because the HTTP process and the launcher, which never import
torch, wait on the scheduler with this figure.
"""

from __future__ import annotations

from typing import Any

SHUTDOWN_SAVE_S = 10.0  # the most a stopping scheduler spends saving unsaved nodes (the launcher waits this long)


def scheduler_stop_timeout(args: Any, base: float) -> float:
    """How long a stopping server waits for its scheduler: longer with a disk tier, which saves on the way out."""
    return base + (SHUTDOWN_SAVE_S + 5.0 if args.enable_hierarchical_cache else 0.0)
