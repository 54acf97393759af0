"""What speculative decoding hands from the scheduler to the execution layer.

    SpeculativeAlgorithm   what --speculative-algorithm names, parsed once (ModelRunner.spec_algorithm)
    Draft                  one request's proposal: tokens, and the distribution they were drawn from
    VerifyInput            ModelWorkerBatch.spec_info of a TARGET_VERIFY step (per request, in order)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class SpeculativeAlgorithm(Enum):
    NONE = "none"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"

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


@dataclass
class Draft:
    """Up to k tokens proposed to follow a request's verified tokens.

    probs: [len(tokens), vocab] the distribution q_j each token was sampled from (a draft model sampling
    a request with temperature > 0); None = a point mass (n-gram lookup, greedy drafts), which the
    rejection rule keeps with probability p(x) (layers/rejection_sampler.py)."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def cut(self, n: int) -> Draft:
        return self if n >= len(self.tokens) else Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


@dataclass
class VerifyInput:
    """A TARGET_VERIFY step's drafts, per request in batch order: request i owns rows
    sum(1 + draft_lens[:i]) .. + draft_lens[i] of the step (its last verified token, then its drafts,
    whose ids are those rows' input ids)."""

    draft_lens: list[int]
    draft_probs: list[torch.Tensor | None]
