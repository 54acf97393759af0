"""ScheduleBatch: the scheduler's view of one step, and the hand-over to execution.

    Req (scheduler)  ->  ScheduleBatch (CPU, scheduler)  ->  ModelWorkerBatch  ->  ForwardBatch  ->  ModelRunner
                         who runs and why: reqs, prefix     plain snapshot       device tensors
                         matches, KV slots allocated here   (no live Reqs)

The batch allocates KV slots (out_cache_loc) and req_to_token rows *here*, in prepare_for_*;
the execution layer only writes where it is told.

Slot bookkeeping of one EXTEND request (page_size 1 shown):

    req_to_token[row]:  [ prefix slots (from the tree / earlier chunk) | out_cache_loc of this step ]
                          0 ............................ prefix_len-1  prefix_len ........ seq_len-1
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.constrained.xgrammar_backend import (
    fill_draft_masks,
    fill_vocab_mask,
    new_bitmask,
    valid_draft_prefix,
)
from radixserve.exceptions import OutOfKVSlots
from radixserve.managers.req import Req
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.request_slots import RequestSlots
from radixserve.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixserve.multimodal.mm_inputs import MultimodalInputs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.speculative.spec_info import Draft, VerifyInput


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    forward_mode: ForwardMode = ForwardMode.IDLE
    input_ids: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor | None = None
    # MIXED: how many of `reqs` (at the front) are the prefill part
    num_extend_reqs: int = 0
    # TARGET_VERIFY with constrained requests: the grammar bitmask of every verified position
    spec_vocab_mask: torch.Tensor | None = None

    def batch_size(self) -> int:
        return len(self.reqs)

    # ------------------------------------------------------------------ slots
    def __post_init__(self) -> None:
        self.slots = RequestSlots(self.req_to_token_pool, self.allocator)

    def _alloc(self, reqs: list[Req], prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """Slots for positions [prefix_len, seq_len) of each request, written into its row; the tree
        is evicted first if the pool is short."""
        self.tree_cache.release_outside_window(reqs, prefix_lens)
        out = self.slots.alloc([r.req_pool_idx for r in reqs], prefix_lens, seq_lens, self.tree_cache.evict)
        if out is None:
            raise OutOfKVSlots(f"no KV slots for {sum(seq_lens) - sum(prefix_lens)} tokens")
        return out

    # ------------------------------------------------------------------ prepare
    def prepare_for_extend(self) -> None:
        """Rows, prefix slots and new slots for each admitted request; input = the uncached part."""
        self.forward_mode = ForwardMode.EXTEND
        new_rows: list[Req] = []
        try:
            for req in self.reqs:
                if req.req_pool_idx is None:
                    idx = self.req_to_token_pool.alloc()
                    if idx is None:
                        raise OutOfKVSlots("no free req_to_token row")
                    req.req_pool_idx = idx
                    new_rows.append(req)
                if len(req.prefix_indices):
                    self.req_to_token_pool.write(req.req_pool_idx, 0, req.prefix_indices)
            self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
            self.seq_lens = [len(r.fill_ids) for r in self.reqs]
            self.out_cache_loc = self._alloc(self.reqs, self.prefix_lens, self.seq_lens)
        except OutOfKVSlots:
            for req in new_rows:  # leave the pools exactly as they were
                self.req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
            raise
        self.input_ids = [t for r, p in zip(self.reqs, self.prefix_lens) for t in r.fill_ids[p:]]
        if all(p == 0 for p in self.prefix_lens):
            self.forward_mode = ForwardMode.PREFILL
        self.num_extend_reqs = len(self.reqs)

    def release_outside_window(self) -> None:
        """Before the next decode or verify step (queries from position seqlen - 1 on): a hybrid pool's local KV
        of the running requests' positions that have left their window goes back (BasePrefixCache)."""
        self.tree_cache.release_outside_window(self.reqs, [r.decode_len - 1 for r in self.reqs])

    def decode_slots_needed(self) -> int:
        """Slots (in whole pages) the next decode step takes from the allocator."""
        return self.slots.slots_needed([r.decode_len - 1 for r in self.reqs], [r.decode_len for r in self.reqs])

    def prepare_for_decode(self) -> None:
        """One new token per request: the last sampled one is written at position seqlen - 1 (a replaying
        request's next known token at decode_len - 1: Req)."""
        self.forward_mode = ForwardMode.DECODE
        self.input_ids = [r.decode_input_id for r in self.reqs]
        self.seq_lens = [r.decode_len for r in self.reqs]
        self.prefix_lens = [s - 1 for s in self.seq_lens]
        self.out_cache_loc = self._alloc(self.reqs, self.prefix_lens, self.seq_lens)
        self.num_extend_reqs = 0

    def prepare_for_verify(self, drafts: list[Draft]) -> None:
        """TARGET_VERIFY: each request's last sampled token followed by its own drafts (0 .. k of them;
        a request without drafts is a one-row member, computed exactly as its DECODE step would be).

        Slots are allocated for every verified position; after verification the scheduler gives back
        those past the tokens produced (release_rejected), so the KV and the radix cache only ever hold
        verified tokens. Row layout (speculative/spec_info.py VerifyInput):

            request A, 2 drafts:  [t_last d_1 d_2]   request B, none: [t_last]   C, 1 draft: [t_last d_1]
        """
        self.forward_mode = ForwardMode.TARGET_VERIFY
        grammars = [r.grammar for r in self.reqs]
        # a constrained request's draft stops before its first token the grammar rejects
        drafts = [d if g is None else d.cut(len(valid_draft_prefix(g, d.tokens))) for g, d in zip(grammars, drafts)]
        widths = [1 + len(d.tokens) for d in drafts]
        self.spec_vocab_mask = None
        if any(g is not None for g in grammars):
            first = next(g for g in grammars if g is not None)
            self.spec_vocab_mask = new_bitmask(sum(widths), first.vocab_size)
            row = 0
            for g, d, w in zip(grammars, drafts, widths):
                if g is not None:
                    fill_draft_masks(g, d.tokens, self.spec_vocab_mask, row)
                row += w
        self.input_ids = []
        for r, d in zip(self.reqs, drafts):
            r.spec_draft = d
            self.input_ids += [r.output_ids[-1], *d.tokens]
        self.prefix_lens = [r.seqlen - 1 for r in self.reqs]
        self.seq_lens = [p + w for p, w in zip(self.prefix_lens, widths)]
        self.out_cache_loc = self._alloc(self.reqs, self.prefix_lens, self.seq_lens)
        self.num_extend_reqs = 0

    def verify_slots_needed(self, draft_lens: list[int]) -> int:
        """Slots (in whole pages) prepare_for_verify takes for drafts of these lengths."""
        prefix = [r.seqlen - 1 for r in self.reqs]
        return self.slots.slots_needed(prefix, [p + 1 + k for p, k in zip(prefix, draft_lens)])

    def release_rejected(self, req: Req, alloc_len: int) -> None:
        """Give back the slots a verify step allocated past the request's verified tokens (seqlen - 1)."""
        keep = req.seqlen - 1
        self.slots.truncate(req.req_pool_idx, keep, alloc_len)
        req.kv_len = min(alloc_len, keep)

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the running requests' decode tokens to this prefill batch (one MIXED forward).

        A decode inside MIXED is an EXTEND of length 1 whose prefix is its whole history."""
        dec_prefix = [r.decode_len - 1 for r in running.reqs]
        dec_seq = [r.decode_len for r in running.reqs]
        locs = running._alloc(running.reqs, dec_prefix, dec_seq)
        self.forward_mode = ForwardMode.MIXED
        self.num_extend_reqs = len(self.reqs)
        self.reqs = self.reqs + running.reqs
        self.input_ids = self.input_ids + [r.decode_input_id for r in running.reqs]
        self.prefix_lens = self.prefix_lens + dec_prefix
        self.seq_lens = self.seq_lens + dec_seq
        self.out_cache_loc = torch.cat([self.out_cache_loc, locs])

    # ------------------------------------------------------------------ membership
    def filter_batch(self, keep: list[Req] | None = None) -> None:
        """Keep only unfinished requests (or exactly `keep`)."""
        self.reqs = [r for r in self.reqs if not r.finished()] if keep is None else keep

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs

    def retract_decode(self, needed: int, replay: bool = False) -> list[Req]:
        """Free KV by sending requests back to the queue until `needed` slots are free.

        Victims: most generated tokens first (they cost the most to hold), then longest prompt.
        Their KV is handed to the prefix cache (kept if the tree shares, freed otherwise), so a
        re-admitted request recomputes only what was evicted meanwhile, or (`replay`) prefills its prompt
        and rebuilds its outputs' KV by decode steps (Req)."""
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), len(r.origin_input_ids)))
        retracted: list[Req] = []
        while order and len(order) > 1 and self.allocator.available_size() < needed:
            req = order.pop()
            self.tree_cache.cache_finished_req(req, kv_len=req.kv_len)
            req.reset_for_retract()
            req.replay = replay and bool(req.output_ids)
            retracted.append(req)
            self.tree_cache.evict(needed)
        self.reqs = [r for r in self.reqs if r not in retracted]
        return retracted

    def split(self) -> tuple[ScheduleBatch, ScheduleBatch]:
        """Two halves of a prepared batch, each runnable on its own (the same slots, rows and
        inputs, sliced): the scheduler bisects a failing step with them to find the request a
        failure belongs to. Re-running a slice rewrites the same KV slots with the same values."""
        mid = len(self.reqs) // 2
        return self._slice(0, mid), self._slice(mid, len(self.reqs))

    def _slice(self, lo: int, hi: int) -> ScheduleBatch:
        assert self.out_cache_loc is not None
        ext = [s - p for p, s in zip(self.prefix_lens, self.seq_lens)]
        t_lo, t_hi = sum(ext[:lo]), sum(ext[:hi])
        n_ext = max(0, min(hi, self.num_extend_reqs) - lo)
        prefix_lens = self.prefix_lens[lo:hi]
        if self.forward_mode.is_decode() or n_ext == 0:
            mode = ForwardMode.DECODE if self.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED) \
                else self.forward_mode
        elif n_ext < hi - lo:
            mode = ForwardMode.MIXED
        else:
            mode = ForwardMode.PREFILL if all(p == 0 for p in prefix_lens) else ForwardMode.EXTEND
        return ScheduleBatch(
            self.reqs[lo:hi], self.req_to_token_pool, self.allocator, self.tree_cache, forward_mode=mode,
            input_ids=self.input_ids[t_lo:t_hi], seq_lens=self.seq_lens[lo:hi], prefix_lens=prefix_lens,
            out_cache_loc=self.out_cache_loc[t_lo:t_hi], num_extend_reqs=n_ext,
            spec_vocab_mask=None if self.spec_vocab_mask is None else self.spec_vocab_mask[t_lo:t_hi],
        )

    # ------------------------------------------------------------------ hand-over
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        """The snapshot execution needs. Sampling is described per sampled row: one per request, or
        (TARGET_VERIFY) one per verified position, whose history holds the drafts before it, so that
        penalties, min_new_tokens and seeds see at each position what plain decoding would see there."""
        assert self.out_cache_loc is not None
        verify = self.forward_mode.is_target_verify()
        widths = [s - p for p, s in zip(self.prefix_lens, self.seq_lens)] if verify else [1] * len(self.reqs)
        req_params = [r.sampling_params for r in self.reqs]
        params = [p for p, w in zip(req_params, widths) for _ in range(w)]
        history = None
        if SamplingBatchInfo.needs_history(req_params):
            history = [r.output_ids + r.spec_draft.tokens[:j] if verify else list(r.output_ids)
                       for r, w in zip(self.reqs, widths) for j in range(w)]
        prompts = None
        if any(p.repetition_penalty != 1.0 for p in req_params):  # it covers the prompt too (vLLM / HF)
            prompts = [r.vocab_input_ids for r, w in zip(self.reqs, widths) for _ in range(w)]
        return_logprob = any(r.return_logprob for r in self.reqs)
        targets: list[list[int] | None] = []
        for r, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens):
            # prompt logprobs: the token after each computed prompt position
            want = r.return_prompt_logprob and not r.output_ids and self.forward_mode.is_extend() and not verify
            targets.append(r.vocab_input_ids[p + 1 : s + 1] if want else None)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=list(self.input_ids),
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            seq_lens=list(self.seq_lens),
            prefix_lens=list(self.prefix_lens),
            out_cache_loc=self.out_cache_loc,
            sampling_params=params,
            output_ids=history,
            prompt_ids=prompts,
            return_logprob=return_logprob,
            top_logprobs_nums=[r.top_logprobs_num for r, w in zip(self.reqs, widths) for _ in range(w)]
            if return_logprob else [],
            prompt_logprob_targets=targets if any(t is not None for t in targets) else [],
            token_ids_logprobs=[r.token_ids_logprob for r, w in zip(self.reqs, widths) for _ in range(w)]
            if any(r.token_ids_logprob for r in self.reqs) else [],
            spec_info=VerifyInput([w - 1 for w in widths], [r.spec_draft.probs for r in self.reqs]) if verify else None,
            vocab_mask=self.vocab_mask(),
            num_extend_reqs=self.num_extend_reqs if self.forward_mode.is_mixed() else None,
            lora_uids=[r.lora_uid for r in self.reqs] if any(r.lora_uid for r in self.reqs) else None,
            mm_inputs=self._mm_inputs(),
            mrope_inputs=[r.mm_inputs for r in self.reqs] if any(
                r.mm_inputs is not None and r.mm_inputs.mrope_positions is not None for r in self.reqs) else None,
        )

    def _mm_inputs(self) -> list[MultimodalInputs | None] | None:
        """Per request, its images when this step computes some of their tokens; None when none does."""
        if self.forward_mode.is_decode() or not any(r.mm_inputs is not None for r in self.reqs):
            return None
        out = [r.mm_inputs if r.mm_inputs is not None and r.mm_inputs.overlaps(p, s) else None
               for r, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens)]
        return out if any(m is not None for m in out) else None

    def vocab_mask(self) -> torch.Tensor | None:
        """The batch's grammar bitmask, a row per sampled position; None when nothing is constrained.
        TARGET_VERIFY masks were built with the drafts (prepare_for_verify)."""
        if self.forward_mode.is_target_verify():
            return self.spec_vocab_mask
        if not any(r.grammar is not None for r in self.reqs):
            return None
        # a request mid chunked prefill samples nothing this step
        return fill_vocab_mask([None if r.is_chunked else r.grammar for r in self.reqs])
