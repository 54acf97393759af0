"""NgramWorker: propose -> verify -> accept, the scheduler's speculative step.

    prepare_verify(sched)   instead of a DECODE step: drafts for the running batch; if there are any and
                            the pool has a slot for every verified position, the batch becomes a
                            TARGET_VERIFY step (ScheduleBatch.prepare_for_verify); drafts never retract
    process_verify_one(..)  after it: accept, append the produced tokens one by one with the stop checks
                            (EOS, stop strings, max_new_tokens, context) between them, then free the slots
                            past the verified tokens (ScheduleBatch.release_rejected): the KV a request
                            keeps and the radix cache only ever hold verified tokens. A failing verify is
                            bisected like any step (the drafts live on each Req).

    propose(reqs)     draft tokens per request (n-gram lookup over its own tokens), or None for a step
                      that should run as plain DECODE (no request has a draft, or one cannot take part)
    accept(...)       greedy verification of one request: the target's argmax at each verified position
                      t_0 .. t_{L-1}; draft j+1 is accepted while it equals t_j, and the run ends with
                      the target's own token (the bonus). The tokens produced are exactly t_0 .. t_a:
                      what plain greedy decoding would produce, a + 1 tokens for one forward.

Which requests take part: greedy ones without penalties, logit_bias, pending min_new_tokens or
logprobs (their next-token rule is argmax of the raw logits, which is what the verify forward returns
per position). A step where any running request is not eligible runs as plain DECODE, so speculation
never changes what such a request gets. The draft length adapts per request: after a verify in which
nothing was accepted it halves (down to 0: that request drafts nothing for RETRY_AFTER_STEPS steps,
then tries one token), after a full acceptance it doubles back up to --speculative-num-draft-tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from radixserve.constrained.grammar_queue import GrammarQueue
from radixserve.managers.schedule_batch import OutOfKVSlots
from radixserve.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from radixserve.managers.req import Req
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs


RETRY_AFTER_STEPS = 8


def spec_eligible(req: Req) -> bool:
    p = req.sampling_params
    return (p.temperature == 0.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and p.repetition_penalty == 1.0 and not p.logit_bias and len(req.output_ids) >= p.min_new_tokens
            and not req.return_logprob)


class NgramWorker:
    def __init__(self, args: ServerArgs, context_len: int, row_cap: int | None = None) -> None:
        """row_cap: with low-bit weights, steps of <= row_cap rows run the low-bit path and longer ones
        float32 or bf16 (ModelRunner.quant_max_rows; None = every step runs low-bit). A batch that decodes on the low-bit path verifies
        on it too (drafts are cut so that requests x (1 + drafts) <= row_cap), so speculation never
        moves a request to other kernels than plain decoding would use: its tokens stay identical."""
        self.row_cap = row_cap
        self.max_draft = args.speculative_num_draft_tokens
        self.min_window = args.speculative_ngram_min_match_window
        self.max_window = args.speculative_ngram_max_match_window
        self.context_len = context_len
        self.verify_ct = 0
        self.accepted_tokens = 0  # tokens produced by verify forwards (bonus included)

    @staticmethod
    def create(args: ServerArgs, runner: ModelRunner) -> NgramWorker | None:
        """The runner's worker (None without --speculative-algorithm ngram)."""
        if not runner.spec_algorithm.is_ngram():
            return None
        return NgramWorker(args, runner.model_config.context_len,
                           runner.quant_max_rows if runner.quant_ops is not None else None)

    @staticmethod
    def info(worker: NgramWorker | None) -> dict[str, float]:
        """get_server_info's speculative counters (zeros without a worker)."""
        if worker is None:
            return {"spec_verify_ct": 0, "spec_accept_length": 0.0}
        return {"spec_verify_ct": worker.verify_ct, "spec_accept_length": worker.mean_accept_length()}

    def _index(self, req: Req) -> NgramIndex:
        idx = req.spec_index
        if idx is None:
            idx = req.spec_index = NgramIndex(self.min_window, self.max_window)
            req.spec_draft_len = self.max_draft
        seen, n_in = len(idx.tokens), len(req.origin_input_ids)
        if seen < n_in:  # first time: the prompt (slices of what is new only, never a concatenation)
            idx.extend(req.origin_input_ids[seen:])
        idx.extend(req.output_ids[max(0, seen - n_in):])
        return idx

    def propose(self, reqs: list[Req]) -> list[list[int]] | None:
        if not reqs or not all(spec_eligible(r) for r in reqs):
            return None
        cap = self.max_draft
        if self.row_cap is not None and len(reqs) <= self.row_cap:
            cap = min(cap, self.row_cap // len(reqs) - 1)
            if cap <= 0:
                return None
        drafts = []
        for r in reqs:
            # room: the verify writes seqlen - 1 + L positions, and more than max_new_tokens is waste
            room = min(self.context_len - r.seqlen, r.sampling_params.max_new_tokens - len(r.output_ids) - 1)
            if r.spec_index is not None and r.spec_draft_len == 0:
                r.spec_retry_in -= 1
                if r.spec_retry_in <= 0:  # random text for a while: try a one-token draft again
                    r.spec_draft_len = 1
            k = max(0, min(r.spec_draft_len if r.spec_index is not None else self.max_draft, room, cap))
            drafts.append(self._index(r).propose(k) if k > 0 else [])
        if not any(drafts):
            return None
        return drafts

    def accept(self, req: Req, targets: list[int], draft: list[int]) -> list[int]:
        """The tokens one verify forward produced for `req` (its drafts' positions included)."""
        a = 0
        while a < len(draft) and draft[a] == targets[a]:
            a += 1
        out = targets[: a + 1]
        self.verify_ct += 1
        self.accepted_tokens += len(out)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += len(out)
        if draft:
            if a == 0:
                req.spec_draft_len = req.spec_draft_len // 2
                if req.spec_draft_len == 0:
                    req.spec_retry_in = RETRY_AFTER_STEPS
            elif a == len(draft):
                req.spec_draft_len = min(self.max_draft, max(1, req.spec_draft_len) * 2)
        return out

    def mean_accept_length(self) -> float:
        return self.accepted_tokens / self.verify_ct if self.verify_ct else 0.0

    # ------------------------------------------------------------------ the scheduler's step
    def prepare_verify(self, sched: Scheduler) -> bool:
        """Turn the running batch into a TARGET_VERIFY step; False = run plain DECODE."""
        drafts = self.propose(sched.running_batch.reqs)
        if drafts is None:
            return False
        try:
            sched.running_batch.prepare_for_verify(drafts)  # its slot allocation evicts the tree if needed
        except OutOfKVSlots:
            return False  # drafts are optional: the step decodes (prepare_for_decode resets the batch)
        return True

    def process_verify_one(self, sched: Scheduler, batch: ScheduleBatch, i: int, req: Req,
                           next_ids: list[int]) -> None:
        alloc_len = batch.seq_lens[i]
        width = alloc_len - batch.prefix_lens[i]
        req.kv_len = alloc_len
        if req.finished():
            return  # aborted while this step ran (its slots went with it)
        produced = self.accept(req, next_ids[i * width : (i + 1) * width], req.spec_draft)
        reason = None
        for tok in produced:
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            sched.stats["generation_tokens"] += 1
            reason = sched.output_processor.check_finished(req, sched.model_config.context_len)
            if req.grammar is not None:
                reason = GrammarQueue.advance(req, tok, reason)
            if reason is not None:
                break
        batch.release_rejected(req, alloc_len)
        req.spec_draft = []
        if reason is not None:
            sched._finish(req, reason)
        else:
            sched.output_processor.maybe_stream(req)
