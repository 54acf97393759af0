"""Speculative decoding: propose draft tokens, verify them in one TARGET_VERIFY forward, keep what the
rejection rule accepts.

    spec_info.py     SpeculativeAlgorithm (ModelRunner.spec_algorithm), Draft, VerifyInput (the hand-over)
    spec_worker.py   SpecWorker: the scheduler's propose -> verify -> accept step, adaptive draft lengths
    proposer.py      DraftProposer: the interface drafts come from
    ngram.py         NgramIndex / NgramProposer: prompt-lookup drafts from a request's own tokens
    draft_model.py   DraftModelProposer: a smaller model with its own KV pool, run k steps ahead

The rule itself runs in the execution layer: layers/rejection_sampler.py.
"""

from radixserve.speculative.spec_info import SpeculativeAlgorithm

__all__ = ["SpeculativeAlgorithm"]
