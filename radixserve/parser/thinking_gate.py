"""ThinkingGate: one request's view of where its thinking ends, on the scheduler side.

It stands in the request's grammar slot (req.grammar) and follows the same protocol as a
constrained/xgrammar_backend.Grammar (accept / rollback / fill / is_terminated), so the scheduler,
the batch's vocabulary mask and speculative verification treat it as any grammar:

- while the request thinks, every token is allowed (the thinking is free text) and the request's own
  grammar (json_schema / regex / ebnf / the tool-call structural tag), if any, waits;
- the thinking ends when the decoded output contains `</think>`; from the next token on the inner
  grammar constrains the answer;
- "pending" (the prompt left the model free to open `<think>` or to answer at once, Qwen3's way): with
  an inner grammar the mask allows what the grammar allows plus the next token of `<think>`'s canonical
  tokens, so the output is either a thinking or a valid answer;
- with a thinking budget, once `budget` tokens were thought the mask allows only the next token of
  `</think>` (its canonical token ids), so the end marker is forced and the answer follows.

`reasoning_tokens` counts the output tokens up to and including the one that completed `</think>`
(the whole output while it never closes) — usage.completion_tokens_details.reasoning_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.parser.reasoning_parser import THINK_END, THINK_START

THINKING, PENDING = "thinking", "pending"  # SamplingParams.reasoning_start values
REASONING_STARTS = (THINKING, PENDING)


@dataclass
class _Step:
    """What accepting one token did, so rollback can undo it."""

    phase: str  # the phase before the token: "pending" | "thinking" | "answer"
    forced_pos: int  # index into end_ids of the forced marker before the token
    inner_accepted: int  # tokens handed to the inner grammar by this step
    reasoning_before: int  # reasoning_tokens before the token


class ThinkingGate:
    def __init__(self, start: str, budget: int | None, end_ids: Sequence[int], vocab_size: int,
                 decode: Callable[[list[int]], str], inner: Any = None, start_ids: Sequence[int] = ()) -> None:
        if start not in REASONING_STARTS:
            raise ValueError(f"reasoning_start must be one of {REASONING_STARTS}, got {start!r}")
        self.phase = start
        self.budget = budget
        self.end_ids = list(end_ids)
        self.start_ids = list(start_ids)  # `<think>`'s canonical tokens (the pending mask)
        self.vocab_size = vocab_size
        self.decode = decode
        self.inner = inner  # the request's own grammar, applied to the answer only
        self.tokens: list[int] = []
        self.steps: list[_Step] = []
        self.forced_pos = -1  # >= 0: forcing end_ids[forced_pos] next
        self.reasoning_tokens = 0
        self._window = len(THINK_END) + 1  # a marker of L chars spans at most L tokens (+1 started mid-way)

    # ------------------------------------------------------------------ the grammar protocol
    def accept(self, token_id: int) -> bool:
        if self.phase == "dead":
            return False
        step = _Step(self.phase, self.forced_pos, 0, self.reasoning_tokens)
        if self.phase == "answer":
            if self.inner is not None:
                if not self.inner.accept(token_id):
                    return False
                step.inner_accepted = 1
            self.tokens.append(token_id)
            self.steps.append(step)
            return True
        if self.forced_pos >= 0 and token_id != self.end_ids[self.forced_pos]:
            return False
        self.tokens.append(token_id)
        self.steps.append(step)
        self._advance_thinking(step)
        return True

    def _advance_thinking(self, step: _Step) -> None:
        if self.phase == PENDING:
            if self.inner is not None:  # the mask allowed the canonical `<think>` tokens or the grammar's
                k = len(self.tokens)
                opening = self.tokens == self.start_ids[:k]
                opened, answering = opening and k == len(self.start_ids), not opening
            else:  # free text: any spelling of `<think>`, after any whitespace
                head = self.decode(self.tokens).lstrip()
                opened, answering = head.startswith(THINK_START), bool(head) and not THINK_START.startswith(head)
            if opened:
                self.phase = THINKING
            elif answering:
                # no thinking in this output: the tokens so far are the answer's first ones
                self.phase, self.reasoning_tokens = "answer", 0
                step.inner_accepted = self._feed_inner(self.tokens)
                return
        self.reasoning_tokens = len(self.tokens)
        if self.forced_pos >= 0:
            self.forced_pos += 1
        window = self.tokens[-self._window:]
        if THINK_END in self.decode(window) and THINK_END not in self.decode(window[:-1]):
            self.phase, self.forced_pos = "answer", -1
            return
        if self.forced_pos < 0 and self.budget is not None and self.phase == THINKING \
                and self.reasoning_tokens >= self.budget:
            self.forced_pos = 0

    def _feed_inner(self, tokens: list[int]) -> int:
        if self.inner is None:
            return 0
        for k, tok in enumerate(tokens):
            if not self.inner.accept(tok):
                self.inner.rollback(k)
                # the answer's first tokens already break the constraint: nothing is allowed from here
                self.phase = "dead"
                return 0
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            step = self.steps.pop()
            self.tokens.pop()
            if step.inner_accepted and self.inner is not None:
                self.inner.rollback(step.inner_accepted)
            self.phase, self.forced_pos, self.reasoning_tokens = step.phase, step.forced_pos, step.reasoning_before

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner is not None and self.inner.is_terminated()

    def fill(self, bitmask: Any, row: int) -> None:
        if self.phase == "dead":
            bitmask[row].zero_()
        elif self.phase == "answer":
            if self.inner is not None:
                self.inner.fill(bitmask, row)
        elif self.phase == PENDING and self.inner is not None:
            self._fill_pending(bitmask, row)
        elif self.forced_pos >= 0:
            tok = self.end_ids[self.forced_pos]
            bitmask[row].zero_()
            bitmask[row, tok // 32] = _bit(tok % 32)
        # thinking: the row stays all-allowed (a fresh bitmask allows every token)

    def _fill_pending(self, bitmask: Any, row: int) -> None:
        """What the inner grammar allows after the tokens so far (when it accepts them: they may still
        become the answer), plus the next token of `<think>` while they spell its start."""
        k, fed = len(self.tokens), 0
        for tok in self.tokens:
            if not self.inner.accept(tok):
                break
            fed += 1
        if fed == k:
            self.inner.fill(bitmask, row)
        else:
            bitmask[row].zero_()
        self.inner.rollback(fed)
        if k < len(self.start_ids) and self.tokens == self.start_ids[:k]:
            tok = self.start_ids[k]
            bitmask[row, tok // 32] |= _bit(tok % 32)

    def allows_any_token(self) -> bool:
        if self.phase == "dead":
            return False
        if self.phase == "answer" and self.inner is not None:
            return self.inner.allows_any_token()
        return True


def _bit(k: int) -> int:
    """Bit k of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k


_MARKER_IDS: dict[int, tuple[list[int], list[int]]] = {}  # id(tokenizer) -> (<think>, </think>) token ids


def gate_for(params: Any, tokenizer: Any, vocab_size: int) -> ThinkingGate | None:
    """The gate a request's sampling params ask for (reasoning_start set by the chat route when a
    reasoning parser is on), or None."""
    if params.reasoning_start is None:
        return None
    ids = _MARKER_IDS.get(id(tokenizer))
    if ids is None:
        ids = _MARKER_IDS[id(tokenizer)] = tuple(list(tokenizer.encode(m, add_special_tokens=False))
                                                 for m in (THINK_START, THINK_END))

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False)

    return ThinkingGate(params.reasoning_start, params.thinking_budget, ids[1], vocab_size, decode, start_ids=ids[0])


def wrap_compiled(req: Any) -> None:
    """A constrained request's grammar has compiled: with a gate, it waits behind the thinking."""
    gate = req.thinking
    if gate is not None and req.grammar is not gate:
        gate.inner, req.grammar = req.grammar, gate
