"""MultiModalCache: the vision tower's outputs by image hash, least recently used first out, bounded in bytes.

A prompt whose image is cut by chunked prefill computes the span over two or more steps; a second request
with the same image whose prefix match stops inside the span (or before it) needs the same rows. Encoding an
image costs a whole tower pass, so its rows are kept here (SGLang's --mm-encoder-cache; vLLM's encoder
cache). The radix cache already spares the tower for images wholly inside a matched prefix: this covers the
rest. A budget of 0 keeps nothing (every span that is computed runs the tower).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch


class MultiModalCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.encode_s = 0.0  # the tower's (and projector's) time, summed over every miss

    def get_or_encode(self, key: int, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        rows = self.entries.get(key)
        if rows is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return rows
        self.misses += 1
        t0 = time.perf_counter()
        rows = encode()
        self.encode_s += time.perf_counter() - t0
        size = rows.numel() * rows.element_size()
        if size <= self.max_bytes:  # one image larger than the whole budget is used once, never kept
            while self.bytes + size > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self.entries[key] = rows
            self.bytes += size
        return rows

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def info(self) -> dict[str, float]:
        return {"images": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "encode_s": self.encode_s}


def encoder_cache_info(model: object) -> dict[str, dict[str, float]]:
    """/get_server_info's "mm_encoder_cache" for a vision-language model; nothing for a text model."""
    cache = getattr(model, "encoder_cache", None)
    return {} if cache is None else {"mm_encoder_cache": cache.info()}
