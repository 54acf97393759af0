"""radixserve: an LLM serving engine on PyTorch (continuous batching, radix prefix cache over a
paged KV cache, OpenAI-compatible server)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str) -> Any:
    # Lazy: `import radixserve` stays cheap (no torch) until an Engine is asked for.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine  # lazy: `import radixserve` must not pull torch

        return Engine
    if name == "ServerArgs":
        from radixserve.server_args import ServerArgs  # lazy: the package's __getattr__, as for Engine

        return ServerArgs
    raise AttributeError(name)
