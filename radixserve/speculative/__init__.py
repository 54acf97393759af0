"""Speculative decoding: propose draft tokens, verify them in one TARGET_VERIFY forward, accept.

    spec_info.py     SpeculativeAlgorithm (what --speculative-algorithm names; ModelRunner.spec_algorithm)
    ngram.py         NgramIndex: prompt-lookup drafts from a request's own tokens
    spec_worker.py   NgramWorker: the propose -> verify -> accept interface the scheduler calls
"""

from radixserve.speculative.spec_info import SpeculativeAlgorithm

__all__ = ["SpeculativeAlgorithm"]
