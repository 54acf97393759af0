"""Who gets admitted next: queue ordering policies and the PrefillAdder's budgets.

Budgets checked for every admitted request (DESIGN section 5):

    rem_total_tokens   free slots + evictable cache - reservation for the running requests'
                       future tokens (max_new_tokens left * new_token_ratio, which decays)
    rem_input_tokens   --max-prefill-tokens per step
    rem_chunk_tokens   --chunked-prefill-size: a longer prompt is cut, the rest runs next step
    running slots      --max-running-requests
    rem_swa_tokens     a hybrid sliding-window pool's free + tombstonable local slots - each running
                       request's next window of tokens. A prompt longer than what is left is cut into
                       chunks that fit (whatever --chunked-prefill-size says): between chunks the tree
                       tombstones what has left the window, so any prompt the full pool holds can run.

A chunk never ends inside an image span of a model whose image tokens attend to their whole image (Gemma 3:
whole_image_spans): it ends at a page boundary before the span, or, when it starts at or inside one, runs on
to the page boundary past it (over the chunk budget by less than a span and a page).
"""

from __future__ import annotations

from radixserve.managers.req import Req
from radixserve.mem_cache.allocator import round_down_to_page, round_up_to_page
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

# The reservation for a running request's future tokens counts at most this many of them (SGLang
# clips the same estimate): a max_new_tokens in the millions must not block admission forever.
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096


# A waiting request is held back one step when a request admitted in the same step computes the
# next this-many tokens it lacks (SGLang uses 32 as well).
IN_BATCH_PREFIX_TOKENS = 32


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: BasePrefixCache, disable_radix_cache: bool = False) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self.disable_radix_cache = disable_radix_cache

    def calc_priority(self, waiting: list[Req]) -> None:
        """Match every waiting request against the cache and order the queue in place."""
        epoch = self.tree_cache.eviction_epoch()
        for req in waiting:
            req.init_next_round_input()
            match = self.tree_cache.match_prefix(req.prefix_match_key())
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
        if self.tree_cache.eviction_epoch() != epoch:
            # A disk-tier restore made room by evicting: a match taken before it (unlocked until admitted) may
            # name freed slots. Match them all again, restoring nothing more, so no eviction happens this time.
            with self.tree_cache.memory_only():
                for req in waiting:
                    match = self.tree_cache.match_prefix(req.prefix_match_key())
                    req.prefix_indices, req.last_node = match.device_indices, match.last_node
        if self.policy == "lpm":
            # Longest cached prefix first: it needs the least compute and keeps hot nodes locked.
            waiting.sort(key=lambda r: (-r.priority, -len(r.prefix_indices)))
        else:
            waiting.sort(key=lambda r: -r.priority)  # stable: arrival order within a priority

    def wait_for_in_batch_prefix(self, req: Req, admitted: list[Req]) -> bool:
        """True when a request admitted this step is about to compute the next IN_BATCH_PREFIX_TOKENS
        tokens that `req` still lacks: `req` waits one step and then finds them in the tree
        (SGLang's in-batch prefix caching). Without it, 16 requests arriving together with one
        1,000-token system prompt would all prefill it."""
        if self.disable_radix_cache or not admitted or not req.reuse_prefix:
            return False
        start = len(req.prefix_indices)
        window = req.fill_ids[start : start + IN_BATCH_PREFIX_TOKENS]
        if len(window) < IN_BATCH_PREFIX_TOKENS:
            return False
        # LoRA: a prefix computed under another adapter is never shared (mem_cache/cache_namespace.py)
        return any(a.lora_uid == req.lora_uid and a.fill_ids[start : start + IN_BATCH_PREFIX_TOKENS] == window
                   for a in admitted)


class PrefillAdder:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        available_tokens: int,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        max_running_requests: int,
        page_size: int,
        whole_image_spans: bool = False,
    ) -> None:
        self.tree_cache = tree_cache
        self.whole_image_spans = whole_image_spans
        reserved = sum(self._future_tokens(r, new_token_ratio) for r in running)
        self.rem_total_tokens = available_tokens + tree_cache.evictable_size() - reserved
        allocator = tree_cache.token_to_kv_pool_allocator
        self.swa_window: int | None = getattr(allocator, "swa_window", None)
        self.rem_swa_tokens: int | None = None
        if self.swa_window is not None:
            self.rem_swa_tokens = allocator.swa_available_size() + tree_cache.swa_evictable_size() - sum(
                min(self._future_tokens(r, new_token_ratio), self.swa_window) for r in running)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunk_size
        self.rem_running = max_running_requests - len(running)
        self.new_token_ratio = new_token_ratio
        self.page_size = page_size
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None
        # Why add_one_req last said no: the budget that kept the rest of the queue waiting (the
        # step record's wait_reason, shown by the web dashboard).
        self.stop_reason: str | None = None

    @staticmethod
    def _future_tokens(req: Req, ratio: float) -> int:
        left = max(0, min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION) - len(req.output_ids))
        return int(left * ratio)

    def _ceil_page(self, n: int) -> int:
        return round_up_to_page(n, self.page_size)

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a request mid chunked prefill (it already holds a row and its prefix).

        NOTE: a retracted request re-prefills its prompt *and* its outputs (unless it replays them: Req), so
        chunks are cut from what it prefills, not from the prompt alone."""
        full = req.prefill_ids()
        done = len(req.prefix_indices)
        left = len(full) - done
        limit = self._chunk_limit()
        step = left if limit is None else min(left, max(limit, self.page_size))
        step = self._chunk_end(req, done, done + step, len(full)) - done
        req.fill_ids = full[: done + step]
        self._account(req, step, reserve=False)
        self.can_run.append(req)
        self.rem_running -= 1
        return req if len(req.fill_ids) < len(full) else None

    def _chunk_limit(self) -> int | None:
        """The most tokens a prefill may compute this step (None: no limit): the chunk budget, and what a
        hybrid sliding-window pool has left (a page of it kept for waste)."""
        limits = [n for n in (self.rem_chunk_tokens,) if n is not None]
        if self.rem_swa_tokens is not None:
            limits.append(round_down_to_page(self.rem_swa_tokens - self.page_size, self.page_size))
        return min(limits) if limits else None

    def _account(self, req: Req, extend_len: int, reserve: bool) -> None:
        future = self._future_tokens(req, self.new_token_ratio) if reserve else 0
        if self.rem_swa_tokens is not None:
            self.rem_swa_tokens -= self._ceil_page(extend_len) + min(future, self.swa_window or 0)
        # each request may waste up to one partial page
        self.rem_total_tokens -= self._ceil_page(extend_len) + self.page_size + future
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len

    def _chunk_end(self, req: Req, start: int, end: int, full: int) -> int:
        """`end` (of a chunk starting at `start`, a page boundary, of a sequence of `full` tokens) moved off the
        inside of an image span where the model computes each span in one step (the module's docstring)."""
        if not self.whole_image_spans or req.mm_inputs is None or end >= full:
            return end
        moved = True
        while moved and end < full:
            moved = False
            for item in req.mm_inputs.items:
                if item.offset < end < item.end:
                    back = start + round_down_to_page(max(0, item.offset - start), self.page_size)
                    end = back if back > start else min(full, start + round_up_to_page(item.end - start,
                                                                                       self.page_size))
                    moved = back <= start  # forward: the new end may fall in a later span
                    break
        return end

    def add_one_req(self, req: Req) -> bool:
        """Try to admit `req`; False means stop admitting this step (budgets are exhausted)."""
        if self.rem_running <= 0:
            self.stop_reason = "max_running_requests"
            return False
        extend_len = len(req.fill_ids) - len(req.prefix_indices)
        need_total = self._ceil_page(extend_len) + self.page_size + self._future_tokens(req, self.new_token_ratio)
        if need_total > self.rem_total_tokens:
            self.stop_reason = "kv_budget"
            return False
        if self.rem_input_tokens <= 0 or (self.can_run and extend_len > self.rem_input_tokens):
            self.stop_reason = "max_prefill_tokens"
            return False
        # NOTE: lock before anything is evicted for this step, so the matched prefix survives.
        # A locked prefix is no longer evictable: the budget loses exactly what the lock pinned.
        before, swa_before = self.tree_cache.evictable_size(), self.tree_cache.swa_evictable_size()
        self.tree_cache.inc_lock_ref(req.last_node)
        pinned = before - self.tree_cache.evictable_size()
        if need_total + pinned > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            self.stop_reason = "kv_budget"
            return False
        self.rem_total_tokens -= pinned
        if self.rem_swa_tokens is not None:  # and the prefix's last window of local KV
            self.rem_swa_tokens -= swa_before - self.tree_cache.swa_evictable_size()
        limit = self._chunk_limit()
        start = len(req.prefix_indices)
        if limit is not None and extend_len > limit and (
                self._chunk_end(req, start, start + round_down_to_page(limit, self.page_size), len(req.fill_ids))
                < len(req.fill_ids)):
            # Chunk at a page boundary: the tree only holds whole pages.
            chunk = round_down_to_page(limit, self.page_size)
            if chunk > 0:
                chunk = self._chunk_end(req, start, start + chunk, len(req.fill_ids)) - start
            if chunk <= 0:
                self.tree_cache.dec_lock_ref(req.last_node)
                self.stop_reason = "chunked_prefill_size" if limit == self.rem_chunk_tokens else "swa_budget"
                return False
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk]
            req.is_chunked = True
            self.new_chunked_req = req
            self._account(req, chunk, reserve=False)
            self.can_run.append(req)
            self.rem_running -= 1
            self.stop_reason = "chunked_prefill"  # one request is chunked at a time; the rest wait for it
            return False
        self._account(req, extend_len, reserve=True)
        self.can_run.append(req)
        self.rem_running -= 1
        return True

    def undo(self) -> tuple[Req | None, list[Req]]:
        """Take this admission back (its batch could not get KV slots; the pools are unchanged):
        (the continuing chunked request, which keeps its row, prefix and lock; the others, in admission
        order, their prefix locks released, for the front of the waiting queue)."""
        chunked, requeue = None, []
        for req in reversed(self.can_run):
            if req.req_pool_idx is not None:  # only a continuing chunked request holds a row here
                req.is_chunked, chunked = True, req
                continue
            self.tree_cache.dec_lock_ref(req.last_node)
            req.is_chunked = False
            requeue.insert(0, req)
        return chunked, requeue
