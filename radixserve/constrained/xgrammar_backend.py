"""XGrammarBackend: grammars compiled against the model's vocabulary, once per distinct constraint.

Compilation runs in one worker thread (xgrammar releases the GIL while it compiles, so the scheduler
loop keeps stepping; measured: a Python loop keeps ~40% of its speed on 2 cores during a compile),
and its results are kept in an LRU of futures keyed by the constraint's text, so 32 requests with the
same schema compile it once, and a schema seen before is ready at once.

Grammar is one request's matcher: it advances with every token the request accepts, rolls back
rejected speculative drafts, and fills the request's row of the batch's vocabulary bitmask.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixserve.constrained.grammar_spec import GrammarSpec

logger = logging.getLogger(__name__)

# Tokens a matcher can roll back: a speculative verify rejects at most --speculative-num-draft-tokens
# (<= 16) drafts at once.
MAX_ROLLBACK_TOKENS = 32


class Grammar:
    """One request's grammar state (an xgrammar GrammarMatcher)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's (logits') vocabulary, which the bitmask covers

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allows_any_token(self) -> bool:
        """Whether some token can continue from here. A constraint can reach a dead end that compiles
        fine: text this vocabulary cannot spell (a private-use character whose UTF-8 bytes no token
        sequence completes), or a language that is empty past some point."""
        mask = new_bitmask(1, self.vocab_size)
        self.fill(mask, 0)
        return bool((mask != 0).any())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)], every token allowed (bit set = allowed; xgrammar's layout)."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def fill_vocab_mask(grammars: Sequence[Grammar | None]) -> torch.Tensor | None:
    """The batch's bitmask: each constrained row filled by its grammar, the others all-allowed
    (so an unconstrained request sharing the batch sees its logits untouched). None when no row
    is constrained (the common case costs nothing)."""
    first = next((g for g in grammars if g is not None), None)
    if first is None:
        return None
    mask = new_bitmask(len(grammars), first.vocab_size)
    for row, g in enumerate(grammars):
        if g is not None:
            g.fill(mask, row)
    return mask


def valid_draft_prefix(grammar: Grammar, draft: list[int]) -> list[int]:
    """The draft up to its first token the grammar rejects (a masked target never produces it, so
    verifying past it is waste). The matcher is left where it was."""
    kept = 0
    for tok in draft:
        if not grammar.accept(tok):
            break
        kept += 1
        if grammar.is_terminated():  # the stop token: nothing can follow it
            break
    grammar.rollback(kept)
    return draft[:kept]


def fill_draft_masks(grammar: Grammar, draft: list[int], mask: torch.Tensor, row: int) -> None:
    """Speculative verify of a constrained request: row `row + j` of `mask` gets what the grammar
    allows after the first j tokens of a valid draft, j = 0 .. len(draft). The matcher is left
    where it was."""
    grammar.fill(mask, row)
    for j, tok in enumerate(draft):
        grammar.accept(tok)
        if grammar.is_terminated():  # only a draft's last token can be the stop (valid_draft_prefix)
            break
        grammar.fill(mask, row + j + 1)
    grammar.rollback(len(draft))


def apply_vocab_mask_(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Disallowed tokens -> -inf, in place (xgrammar's CPU kernel: 0.16 ms at [32, 49152])."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=logits.shape[-1])


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids) or None)
        # xgrammar's own cache is off: the LRU below bounds entries by count and also dedups
        # requests whose grammar is still compiling.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.lock = threading.Lock()
        self.stats = {"compiled": 0, "cache_hits": 0}

    def compile_async(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (or of the error compiling it raised)."""
        with self.lock:
            fut = self.cache.get(spec.key)
            if fut is not None:
                self.cache.move_to_end(spec.key)
                self.stats["cache_hits"] += 1
                return fut
            fut = self.executor.submit(self._compile, spec)
            self.cache[spec.key] = fut
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec) -> Any:
        self.stats["compiled"] += 1
        c = self.compiler
        if spec.kind == "json_schema":
            # no free whitespace: a small model left free to emit it can pad a JSON value forever
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.value)
        return c.compile_structural_tag(spec.value)

    def new_grammar(self, compiled: Any) -> Grammar:
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS), self.vocab_size)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
