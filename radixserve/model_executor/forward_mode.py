"""ForwardMode: which kind of step a batch is (the seed's forward modes), and CaptureHiddenMode.

A module of its own, without torch: the step records (debug/trace.py) name the mode, and the HTTP process
reads them and never imports torch. forward_batch_info.py re-exports both.
"""

from __future__ import annotations

from enum import IntEnum, auto

__all__ = ["CaptureHiddenMode", "ForwardMode"]


class ForwardMode(IntEnum):
    PREFILL = auto()  # whole prompt, no cached prefix: attention over the new tokens only
    EXTEND = auto()  # new tokens after a cached prefix (radix hit or previous chunk)
    DECODE = auto()  # one token per request against the whole history
    MIXED = auto()  # EXTEND requests and DECODE requests in one forward
    TARGET_VERIFY = auto()  # k draft tokens + 1 per request, causal among themselves, against history
    IDLE = auto()  # no work, but this rank must still join collectives

    def is_extend(self) -> bool:
        """Any mode whose requests may carry more than one query token (the EXTEND family)."""
        return self in (ForwardMode.PREFILL, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class CaptureHiddenMode(IntEnum):
    NULL = 0
    LAST = 1  # hidden state of the last token of each request
    FULL = 2  # hidden state of every token
