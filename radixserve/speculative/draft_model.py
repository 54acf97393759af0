"""DraftModelProposer: drafts from a smaller model of the same vocabulary, run k steps ahead.

The draft is a second ModelRunner (--speculative-draft-model-path: a GGUF file or a Hugging Face folder)
with its own KV pool and req_to_token rows; a request's place there is its DraftState (req.spec_state).
Per verify step, for the requests given k > 0 drafts (verified length L: tokens 0 .. L-1, the last one
sampled but without KV yet):

    catch-up   one forward over what the draft has not seen but the last token: positions [kv_len, L - 1)
               (the whole prompt at first; afterwards nothing, or the last draft after a full accept)
    k          one-token DECODE forwards: the token at position L - 1 + j (the last verified one, then
               d_j) -> d_{j+1}; one row per request, so they run on the decode fast path
    verify     (the target) keeps `a` drafts: positions L .. L + a - 1 hold d_1 .. d_a, which are now
               verified tokens, so the draft keeps its KV for positions < min(L + a, L + k - 1) and gives
               back the rest (RequestSlots.truncate, page rounding included)

Each draft token is drawn as the request would sample it (greedy: the draft's argmax; temperature > 0:
a sample from the draft's processed distribution q, kept for the rejection rule; a constrained request
gets greedy drafts, cut by its grammar). A seeded request's draws come from a stream of their own
(independent of the target's, as the rule needs) and are reproducible.

Catch-up is bounded per step (--chunked-prefill-size tokens): a request with more to catch up proceeds in
chunks and gets no drafts until it is level. A request whose draft slots or row cannot be had gets no
drafts (its state is dropped and rebuilt later); a failing draft forward costs its step the drafts, never
a request. States leave with their requests (release_stale) and --check-invariants accounts the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.exceptions import InvariantError
from radixserve.managers.failure_isolation import is_fatal
from radixserve.mem_cache.request_slots import RequestSlots
from radixserve.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import get_model_config, get_tokenizer, model_kind
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo, salted_seed
from radixserve.speculative.proposer import DraftProposer
from radixserve.speculative.spec_info import Draft

if TYPE_CHECKING:
    from radixserve.managers.req import Req
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

DRAFT_SALT = 0x5EC0_D2AF_7000_0003  # a seeded request's draft stream (sampling_batch_info.salted_seed)


@dataclass
class DraftState:
    """A request's place in the draft model's pool."""

    row: int  # its row of the draft's req_to_token pool
    kv_len: int = 0  # positions 0 .. kv_len - 1 hold draft KV of tokens of the verified sequence (or drafts)
    alloc_len: int = 0  # positions allocated (>= kv_len)
    verify_base: int | None = None  # L of the verify step its drafts are in, None when it has none there


def check_same_vocabulary(args: ServerArgs, target: ModelRunner, draft_path: str) -> None:
    """Start-up: the draft must score the target's token ids. Its vocabulary size must match, and when it
    brings a tokenizer of its own, the same token -> id map."""
    name = "ServerArgs.speculative_draft_model_path"
    if target.model_config.mm_config is not None:
        # the draft would have to embed the image spans too: it has no tower
        raise ValueError(f"{name}: a draft model cannot follow a vision-language target; use "
                         "--speculative-algorithm ngram (its drafts stop at image spans)")
    if not os.path.exists(draft_path):
        raise ValueError(f"{name}: {draft_path!r} does not exist")
    cfg = get_model_config(draft_path)
    if cfg.vocab_size != target.model_config.vocab_size:
        raise ValueError(f"{name}: the draft model's vocabulary has {cfg.vocab_size} tokens, the target's "
                         f"{target.model_config.vocab_size}; a draft must share the target's tokenizer")
    if os.path.realpath(draft_path) == os.path.realpath(target.model_path):
        return
    has_tokenizer = model_kind(draft_path) == "gguf" or any(
        os.path.exists(os.path.join(draft_path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if has_tokenizer:
        mine = get_tokenizer(target.model_path, args.tokenizer_path).get_vocab()
        theirs = get_tokenizer(draft_path).get_vocab()
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
            raise ValueError(f"{name}: the draft model's tokenizer differs from the target's (e.g. {diff}); "
                             "a draft must share the target's tokenizer")


class DraftModelProposer(DraftProposer):
    def __init__(self, args: ServerArgs, target: ModelRunner) -> None:
        path = args.speculative_draft_model_path
        assert path is not None  # ServerArgs refuses draft_model without it
        check_same_vocabulary(args, target, path)
        k, ps = args.speculative_num_draft_tokens, args.page_size
        # NOTE: no prefix sharing in the draft's pool: every running request holds its whole sequence
        # there, so the pool is the target's plus each request's drafts and partial pages
        pool = target.max_total_num_tokens + args.max_running_requests * (k + 2 * ps)
        draft_args = args.replace(model_path=path, tokenizer_path=None, speculative_algorithm=None,
                                  speculative_draft_model_path=None, max_total_tokens=pool, trace_batches=None,
                                  disable_hybrid_swa_memory=True)
        same = os.path.realpath(path) == os.path.realpath(target.model_path)
        # the same file as the target (self-drafting, the tests' setup): its loaded weights serve both
        self.runner = ModelRunner(draft_args, model=target.model if same else None)
        self.slots = RequestSlots(self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator)
        self.context_len = self.runner.model_config.context_len
        self.catch_up_budget = args.effective_chunk_size or 8192
        self.holders: dict[int, Req] = {}  # id(req) -> req, for every request holding a DraftState
        self.forwards = 0

    # ------------------------------------------------------------------ propose
    def propose(self, reqs: list[Req], lens: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in reqs]
        active = self._reserve(reqs, lens)
        if not active:
            return drafts
        try:
            self._run(reqs, active, drafts)
        except Exception as e:  # a draft failure costs this step its drafts, never a request
            if is_fatal(e):
                raise
            logger.warning("draft model failed (%s: %s); this step verifies no drafts", type(e).__name__, e)
            for i, _ in active:
                self._release(reqs[i])
            return [Draft() for _ in reqs]
        return drafts

    def _reserve(self, reqs: list[Req], lens: list[int]) -> list[tuple[int, int]]:
        """(index, k) of the requests that draft this step, with their draft rows and slots in place; the
        others may still catch up a chunk (then k = 0)."""
        out: list[tuple[int, int]] = []
        budget = self.catch_up_budget
        for i, (r, k) in enumerate(zip(reqs, lens)):
            L = r.seqlen
            st: DraftState | None = r.spec_state
            if st is not None and st.verify_base is not None:
                self.on_verified(r, 0)  # drafted for a verify that never ran: its drafts are undone
            if k <= 0 or L + k > self.context_len or budget <= 0:
                continue
            if st is None:
                row = self.slots.take_row()
                if row is None:
                    continue
                st = r.spec_state = DraftState(row)
                self.holders[id(r)] = r
            gap = L - st.kv_len
            end = L + k - 1 if gap <= budget else st.kv_len + budget
            if self.slots.alloc([st.row], [st.alloc_len], [end]) is None:
                self._release(r)  # no room in the draft pool: drafts wait, the slots go to others
                continue
            st.alloc_len = end
            budget -= min(gap, budget)
            out.append((i, k if end == L + k - 1 else 0))
        return out

    def _run(self, reqs: list[Req], active: list[tuple[int, int]], drafts: list[Draft]) -> None:
        sel = [(reqs[i], k, i) for i, k in active]
        # 1. catch-up: the positions the draft has not seen, but the last verified token's (or as far as
        #    this step's budget goes): the whole prompt at first, afterwards nothing or one kept draft
        pre = []
        for r, k, _ in sel:
            end = r.seqlen - 1 if k > 0 else r.spec_state.alloc_len
            if end > r.spec_state.kv_len:
                pre.append((r, r.spec_state.kv_len, end))
        if pre:
            input_ids: list[int] = []
            for r, p, e in pre:
                n_in = len(r.origin_input_ids)  # slices of prompt and output, never their concatenation
                input_ids += r.origin_input_ids[p:e] + r.output_ids[max(0, p - n_in) : max(0, e - n_in)]
            self._forward([r for r, _, _ in pre], [p for _, p, _ in pre], [e for _, _, e in pre], input_ids,
                          [0] * len(pre))
            for r, _, e in pre:
                r.spec_state.kv_len = e
        # 2. k one-token DECODE steps: step j writes the token at position L - 1 + j (the last verified
        #    one, then d_j) and draws d_{j+1} after it
        drafting = [(r, k, i) for r, k, i in sel if k > 0]
        for r, _, _ in drafting:
            r.spec_state.verify_base = r.seqlen
        for j in range(max((k for _, k, _ in drafting), default=0)):
            step = [(r, i) for r, k, i in drafting if k > j]
            pos = [r.seqlen - 1 + j for r, _ in step]
            last = [r.output_ids[-1] if j == 0 else drafts[i].tokens[-1] for r, i in step]
            out = self._forward([r for r, _ in step], pos, [p + 1 for p in pos], last, [j] * len(step),
                                [drafts[i].tokens for _, i in step])
            for (r, _), p in zip(step, pos):
                r.spec_state.kv_len = p + 1
            self._take([(r, i, row) for row, (r, i) in enumerate(step)], out, drafts)

    @staticmethod
    def _take(drafting: list[tuple[Req, int, int]], out: Any, drafts: list[Draft]) -> None:
        """Append each drafting request's new token (and its q row when it was sampled)."""
        ids = out.next_token_ids.tolist()
        for r, i, row in drafting:
            d = drafts[i]
            d.tokens.append(ids[row])
            if out.probs is not None and DraftModelProposer._sampled(r):
                q = out.probs[row : row + 1]  # [1, vocab]
                d.probs = q if d.probs is None else torch.cat([d.probs, q])

    @staticmethod
    def _sampled(req: Req) -> bool:
        """True when the request's drafts are draws from q (kept for the rule), False for a point mass."""
        return not req.sampling_params.is_greedy and req.grammar is None

    @staticmethod
    def _params(req: Req) -> SamplingParams:
        """How the draft draws for this request: as the request samples, from a stream of its own when
        seeded; greedy for a constrained request (its draft is cut by the grammar, which a point mass allows)."""
        p = req.sampling_params
        if req.grammar is not None and not p.is_greedy:
            return dataclasses.replace(p, temperature=0.0)
        if p.seed is not None:
            return dataclasses.replace(p, seed=salted_seed(p.seed, DRAFT_SALT))
        return p

    def _forward(self, reqs: list[Req], prefix_lens: list[int], seq_lens: list[int], input_ids: list[int],
                 num_drafted: list[int], drafted: list[list[int]] | None = None) -> Any:
        """One draft forward over positions [prefix_len, seq_len) of each request (slots already in its
        row); sampling sees the request's output plus the drafts drawn so far as its history."""
        rows = [r.spec_state.row for r in reqs]
        rtt = self.runner.req_to_token_pool.req_to_token
        locs = torch.cat([rtt[row, p:s] for row, p, s in zip(rows, prefix_lens, seq_lens)])
        params = [self._params(r) for r in reqs]
        history = None
        if SamplingBatchInfo.needs_history(params):
            history = [r.output_ids + (drafted[n][:m] if drafted else []) for n, (r, m) in
                       enumerate(zip(reqs, num_drafted))]
        mwb = ModelWorkerBatch(
            forward_mode=_mode(prefix_lens, seq_lens), input_ids=input_ids, req_pool_indices=rows,
            seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=locs, sampling_params=params,
            output_ids=history,
            prompt_ids=[r.origin_input_ids for r in reqs] if any(p.repetition_penalty != 1.0 for p in params) else None,
            return_probs=any(self._sampled(r) for r in reqs),
        )
        self.forwards += 1
        return self.runner.forward_batch_generation(mwb).sample_output

    # ------------------------------------------------------------------ after verify, lifetime
    def on_verified(self, req: Req, accepted: int) -> None:
        st = req.spec_state
        if not isinstance(st, DraftState) or st.verify_base is None:
            return
        # positions < L + accepted hold verified tokens (the last verified one, then the kept drafts)
        kept = min(st.kv_len, st.verify_base + accepted)
        self.slots.truncate(st.row, kept, st.alloc_len)
        st.kv_len = st.alloc_len = kept
        st.verify_base = None

    def _release(self, req: Req) -> None:
        st: DraftState = req.spec_state
        self.slots.free_row(st.row, 0, st.alloc_len)
        req.spec_state = None
        del self.holders[id(req)]

    def release_stale(self, live: list[Req]) -> None:
        live_ids = {id(r) for r in live}
        for key, req in list(self.holders.items()):
            if key not in live_ids:
                self._release(req)

    def check_memory(self, live: list[Req]) -> None:
        alloc, pool = self.runner.token_to_kv_pool_allocator, self.runner.req_to_token_pool
        ps = alloc.page_size
        seen = alloc.free_slot_set()
        live_ids = {id(r) for r in live}
        rows: set[int] = set()
        for key, req in self.holders.items():
            if key not in live_ids:
                raise InvariantError(f"draft model: request {req.rid} is no longer running but holds draft KV")
            st: DraftState = req.spec_state
            pages = {x // ps for x in pool.req_to_token[st.row, : st.alloc_len].tolist()}
            held = {p * ps + i for p in pages for i in range(ps)}
            if seen & held or st.row in rows:
                raise InvariantError(f"draft model: request {req.rid}'s draft slots or row have two owners")
            seen |= held
            rows.add(st.row)
        if len(seen) != alloc.total_size:
            raise InvariantError(f"draft model KV accounting: {len(seen)} slots free or held != {alloc.total_size}")
        if rows & set(pool.free_slots) or len(rows) + len(pool.free_slots) != pool.size:
            raise InvariantError(f"draft model rows: {len(rows)} held + {len(pool.free_slots)} free != {pool.size}")

    def info(self) -> dict[str, Any]:
        alloc = self.runner.token_to_kv_pool_allocator
        return {"spec_draft_num_used_tokens": alloc.total_size - alloc.available_size(),
                "spec_draft_forward_ct": self.forwards}


def _mode(prefix_lens: list[int], seq_lens: list[int]) -> ForwardMode:
    """The draft forward's mode: one new token each = DECODE; nothing cached = PREFILL; otherwise EXTEND,
    MIXED when some requests add a single token (those then attend on the short-query path)."""
    single = [s - p == 1 and p > 0 for p, s in zip(prefix_lens, seq_lens)]
    if all(single):
        return ForwardMode.DECODE
    if all(p == 0 for p in prefix_lens):
        return ForwardMode.PREFILL
    return ForwardMode.MIXED if any(single) else ForwardMode.EXTEND
