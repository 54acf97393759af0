"""SamplingParams: one request's decoding knobs, as the API layer hands them to the scheduler.

Construction normalises the lenient shapes JSON clients send (``stop`` as one string,
``logit_bias`` keys as strings); ``verify(vocab_size)`` then checks every value and raises a
ValueError whose message starts with the offending field's name, so the HTTP layer can turn
it into a 400 without parsing.

Penalty semantics (applied by SamplingBatchInfo.apply_logits_processing):

    frequency_penalty   logit -= frequency_penalty * count(token in generated tokens)   (OpenAI)
    presence_penalty    logit -= presence_penalty  * (count > 0)                        (OpenAI)
    repetition_penalty  for tokens in prompt + generated: logit > 0 -> logit / p,
                        else logit * p                                             (HF / vLLM)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from radixserve.constrained.grammar_spec import (
    CONSTRAINT_FIELDS,
    MAX_CONSTRAINT_CHARS,
    GrammarSpec,
    normalise_constraint,
)
from radixserve.parser.thinking_gate import REASONING_STARTS

# Below this a temperature is treated as 0: dividing logits by ~1e-7 only amplifies float
# noise, and argmax is what such a request asks for anyway.
GREEDY_TEMPERATURE_EPS = 1e-6

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def _is_int(x: Any) -> bool:
    # bool is an int subclass, but `"max_new_tokens": true` is a client bug, not a count.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    if not (_is_int(x) or isinstance(x, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range (a JSON 1000...0 of 400 digits): not a usable number
        return False


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang / OpenAI naming)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only True: verify() says why False is refused
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    n: int = 1
    # Constrained decoding (constrained/): at most one; a JSON schema or structural tag may be given
    # as an object, it is kept as its JSON text.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # Reasoning (parser/thinking_gate.py), set by the chat route when a reasoning parser is on: where
    # the output starts ("thinking" | "pending": only if it opens with <think>; None = no gate), and
    # the thinking budget in tokens, after which </think> is forced.
    reasoning_start: str | None = None
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        self.normalise()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like dict. None -> all defaults.

        Keys whose value is None count as absent (OpenAI clients send explicit nulls).
        Unknown keys raise ValueError naming all of them. Values are not range-checked here:
        call verify() once the vocabulary size is known.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            # ValueError, not TypeError, for bad types too: the API layer maps it to a 400.
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def normalise(self) -> None:
        """Coerce lenient input shapes in place; leaves bad values for verify() to report.

        ``stop``: None -> [], one str -> [str]; empty strings are dropped (they would match
        before any text exists). ``stop_token_ids``: None -> [], one int -> [int].
        ``logit_bias``: None -> {}, decimal-string keys (JSON objects only have string keys)
        -> int.
        """
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = [s for s in self.stop if s != ""]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif _is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in CONSTRAINT_FIELDS:
            setattr(self, name, normalise_constraint(getattr(self, name), name))
        if self.logit_bias is None:
            self.logit_bias = {}
        elif isinstance(self.logit_bias, dict):
            converted: dict[Any, Any] = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, str):
                    try:
                        k = int(k.strip())
                    except ValueError:
                        raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                converted[k] = v
            self.logit_bias = converted

    # ------------------------------------------------------------------ validation
    def verify(self, vocab_size: int) -> None:
        """Raise ValueError("<field> ...") on the first invalid field; return None if all valid.

        Wrong types raise ValueError too (not TypeError): every rejection is a client error.
        """
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004
        if not self.spaces_between_special_tokens:
            # Refused rather than ignored: the fast tokenizers radixserve loads decide the spacing around
            # special tokens themselves (HF's flag only changes slow tokenizers), so false would change nothing.
            raise ValueError("spaces_between_special_tokens: only true (the default) is supported; special tokens "
                             "are decoded as the model's fast tokenizer writes them")

        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}")  # noqa: TRY004
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids must be ints in [0, {vocab_size}), got {tok!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")  # noqa: TRY004
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {tok!r}")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for {tok}")

        self._verify_reasoning()
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give at most one of {', '.join(CONSTRAINT_FIELDS)}, got {', '.join(given)}")
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")  # noqa: TRY004
            if not 0 < len(value) <= MAX_CONSTRAINT_CHARS:
                raise ValueError(f"{name} must have 1..{MAX_CONSTRAINT_CHARS} characters, got {len(value)}")
            if self.min_new_tokens > 0:
                # holding back EOS could leave a finished grammar no token at all
                raise ValueError(f"min_new_tokens cannot be combined with {name}: the grammar decides where "
                                 "the output ends")

    def _verify_reasoning(self) -> None:
        # the budget's bound (the context length) is checked with the server's limits (check_params)

        if self.reasoning_start is not None and self.reasoning_start not in REASONING_STARTS:
            raise ValueError(f"reasoning_start must be one of {REASONING_STARTS}, got {self.reasoning_start!r}")
        if self.thinking_budget is not None and self.reasoning_start is None:
            raise ValueError("thinking_budget: needs a thinking output (reasoning_start; the chat route sets it "
                             "when the server runs a --reasoning-parser)")

    # ------------------------------------------------------------------ views
    def constraint(self) -> GrammarSpec | None:
        """The grammar this request is constrained by, or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return GrammarSpec(name, value)
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (fresh lists / dicts; logit_bias keys stay int)."""
        return asdict(self)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax: temperature ~0, or top_k == 1 (only one candidate)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """True if any history-based penalty is active (frequency / presence / repetition)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
