"""SpeculativeAlgorithm: the algorithm a runner and its scheduler use, parsed once from ServerArgs."""

from __future__ import annotations

from enum import Enum


class SpeculativeAlgorithm(Enum):
    NONE = "none"
    NGRAM = "ngram"

    @staticmethod
    def from_string(name: str | None) -> SpeculativeAlgorithm:
        if name is None or name.lower() == "none":
            return SpeculativeAlgorithm.NONE
        try:
            return SpeculativeAlgorithm(name.lower())
        except ValueError:
            raise ValueError(f"unknown speculative algorithm {name!r}") from None

    def is_none(self) -> bool:
        return self is SpeculativeAlgorithm.NONE

    def is_ngram(self) -> bool:
        return self is SpeculativeAlgorithm.NGRAM
