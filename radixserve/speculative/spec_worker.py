"""SpecWorker: propose -> verify -> accept, the scheduler's speculative step.

    prepare_verify(batch..) instead of a DECODE step: a draft length per running request (adaptive, see
                            below), slots checked first (drafts may evict the tree, never retract), drafts
                            from the proposer (n-gram lookup or a draft model), and the running batch
                            becomes a TARGET_VERIFY step in which each request verifies its own number
                            of drafts (0 = a plain one-row member: the issue's "DECODE inside a verify
                            batch"); False = no request has a draft: plain DECODE
    process_verify_one(..)  after it: the tokens the rejection sampler produced for the request (its kept
                            drafts + one), appended one by one with the stop checks (EOS, stop strings,
                            max_new_tokens, context) and logprobs between them; then the slots past the
                            verified tokens are given back (ScheduleBatch.release_rejected) and the
                            proposer undoes what it built on rejected drafts: the KV a request keeps and
                            the radix cache only ever hold verified tokens. A failing verify is bisected
                            like any step (the drafts live on each Req).

Every request takes part, whatever its sampling parameters: each verified row is sampled as plain
decoding would sample that step (its penalties, logit_bias and min_new_tokens over a history that
includes the drafts before it, its temperature / top-k / top-p / min-p, its seed's stream), and the
standard rejection rule keeps drafts (layers/rejection_sampler.py), so outputs follow the target
distribution exactly; greedy and seeded requests get token for token what they get without it.

Draft length per request: after a verify that kept none of its drafts it halves (down to 0: no drafts
for RETRY_AFTER_STEPS steps, then one token is tried), after one that kept all of them it doubles back
up to --speculative-num-draft-tokens. Where the low-bit path is capped (ModelRunner.low_bit_row_limit():
--quant-max-rows), a batch that decodes on it verifies on it too (the rows of the step stay
within the cap), so a verified row is computed by the same kernels as the decode step it replaces.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.exceptions import OutOfKVSlots
from radixserve.speculative.draft_model import DraftModelProposer
from radixserve.speculative.ngram import NgramProposer
from radixserve.speculative.spec_info import Draft

if TYPE_CHECKING:
    from radixserve.managers.output_processor import OutputProcessor
    from radixserve.managers.req import FinishReason, Req
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.model_executor.results import SampleOutput
    from radixserve.server_args import ServerArgs
    from radixserve.speculative.proposer import DraftProposer


logger = logging.getLogger(__name__)

RETRY_AFTER_STEPS = 8


class SpecWorker:
    def __init__(self, args: ServerArgs, runner: ModelRunner, proposer: DraftProposer) -> None:
        self.proposer = proposer
        self.max_draft = args.speculative_num_draft_tokens
        self.context_len = runner.model_config.context_len
        # with low-bit weights, steps of <= this many rows run the low-bit path, longer ones the float GEMMs
        # (None: every step is low-bit, nothing to stay within)
        self.low_bit_rows = runner.low_bit_row_limit()
        self.turn = 0  # who gets the first of the rows a low-bit step has to share
        self.verify_ct = 0  # (request, verify forward) pairs in which the request had drafts
        self.accepted_tokens = 0  # tokens those produced (kept drafts + the bonus / corrected one)

    @staticmethod
    def create(args: ServerArgs, runner: ModelRunner) -> SpecWorker | None:
        """The runner's worker (None without --speculative-algorithm)."""
        algo = runner.spec_algorithm
        if algo.is_none():
            return None
        if algo.is_ngram():
            proposer: DraftProposer = NgramProposer(args.speculative_ngram_min_match_window,
                                                    args.speculative_ngram_max_match_window)
        else:
            proposer = DraftModelProposer(args, runner)
        return SpecWorker(args, runner, proposer)

    @staticmethod
    def info(worker: SpecWorker | None) -> dict[str, float]:
        """get_server_info's speculative counters (zeros without a worker)."""
        if worker is None:
            return {"spec_verify_ct": 0, "spec_accept_length": 0.0}
        return {"spec_verify_ct": worker.verify_ct, "spec_accept_length": worker.mean_accept_length(),
                **worker.proposer.info()}

    def mean_accept_length(self) -> float:
        return self.accepted_tokens / self.verify_ct if self.verify_ct else 0.0

    # ------------------------------------------------------------------ draft lengths
    def row_budget(self, num_reqs: int) -> int | None:
        """Most rows a verify step of num_reqs requests may have, None = any: a batch that decodes on the
        capped low-bit path verifies on it too, so its tokens come from the same kernels."""
        cap = self.low_bit_rows
        return cap if cap is not None and num_reqs <= cap else None

    def draft_lens(self, reqs: list[Req]) -> list[int]:
        """How many drafts each request verifies this step."""
        want = []
        for r in reqs:
            if r.spec_draft_len < 0:
                r.spec_draft_len = self.max_draft
            elif r.spec_draft_len == 0:
                r.spec_retry_in -= 1
                if r.spec_retry_in <= 0:  # random text for a while: try a one-token draft again
                    r.spec_draft_len = 1
            # room: the verify writes positions seqlen - 1 .. seqlen - 1 + k, and more than max_new_tokens is waste
            room = min(self.context_len - r.seqlen, r.sampling_params.max_new_tokens - len(r.output_ids) - 1)
            want.append(max(0, min(r.spec_draft_len, room)))
        budget = self.row_budget(len(reqs))
        if budget is None:
            return want
        # share the rows left after each request's own one, a draft at a time in turn, starting from a
        # different request each step so that none is always last
        n = len(reqs)
        lens, left = [0] * n, budget - n
        self.turn = (self.turn + 1) % n
        while left > 0 and any(k < w for k, w in zip(lens, want)):
            for i in [(self.turn + j) % n for j in range(n)]:
                if left > 0 and lens[i] < want[i]:
                    lens[i] += 1
                    left -= 1
        return lens

    def _on_verified(self, req: Req, num_drafts: int, accepted: int) -> None:
        if num_drafts == 0:
            return  # a plain one-row member: no verify for this request
        self.verify_ct += 1
        self.accepted_tokens += accepted + 1
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted + 1
        if accepted == 0:
            req.spec_draft_len //= 2
            if req.spec_draft_len == 0:
                req.spec_retry_in = RETRY_AFTER_STEPS
        elif accepted == num_drafts:
            req.spec_draft_len = min(self.max_draft, max(1, req.spec_draft_len) * 2)

    # ------------------------------------------------------------------ the scheduler's step
    def prepare_verify(self, batch: ScheduleBatch, allocator: TokenToKVPoolAllocator, tree_cache: BasePrefixCache) -> bool:
        """Turn the running batch into a TARGET_VERIFY step; False = run plain DECODE."""
        lens = self.draft_lens(batch.reqs)
        if not any(lens):
            return False
        # the target's slots for every verified position, before any draft is computed: drafts may
        # evict the tree like decode does, but never retract a request
        need = batch.verify_slots_needed(lens)
        if allocator.available_size() < need:
            tree_cache.evict(need - allocator.available_size())
        if allocator.available_size() < need:
            return False
        drafts = self.proposer.propose(batch.reqs, lens)
        try:
            if any(d.tokens for d in drafts):
                batch.prepare_for_verify(drafts)  # fits: drafts are no longer than lens
                return True
        except OutOfKVSlots:  # cannot happen after the check above; if it does, the step just decodes
            logger.warning("no KV slots for the drafts after all; decoding this step")
        for r in batch.reqs:  # whatever the proposer built on these drafts is undone
            r.spec_draft = Draft()
            self.proposer.on_verified(r, 0)
        return False

    def process_verify_one(self, batch: ScheduleBatch, i: int, req: Req, sample: SampleOutput, next_ids: list[int],
                           out: OutputProcessor) -> FinishReason | None:
        """Request i of a TARGET_VERIFY batch (its rows start after the rows of the requests before it): its
        verified tokens through the same token path a DECODE step takes (OutputProcessor.append_token), up to
        the first that finishes it; returns that reason (the scheduler finishes the request)."""
        row = sum(s - p for p, s in zip(batch.prefix_lens[:i], batch.seq_lens[:i]))
        alloc_len = batch.seq_lens[i]
        req.kv_len = alloc_len
        if req.finished():
            return None  # aborted while this step ran (its slots went with it)
        accepted = sample.accept_lens[i]
        self._on_verified(req, len(req.spec_draft.tokens), accepted)
        reason = None
        for j in range(row, row + accepted + 1):
            reason = out.append_token(req, next_ids[j], sample, j)
            if reason is not None:
                break
        batch.release_rejected(req, alloc_len)
        self.proposer.on_verified(req, accepted)
        req.spec_draft = Draft()
        return reason

    # ------------------------------------------------------------------ lifetime
    def release_stale(self, live: list[Req]) -> None:
        self.proposer.release_stale(live)

    def check_memory(self, live: list[Req]) -> None:
        self.proposer.check_memory(live)
