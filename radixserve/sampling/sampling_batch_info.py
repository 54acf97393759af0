"""SamplingBatchInfo: a batch's SamplingParams as device tensors, rebuilt for every step.

It is stateless by design: build() derives everything (penalty counts included) from the token
lists the scheduler already keeps, so requests joining, finishing or being retracted between
steps need no merge/filter bookkeeping here.

Work is proportional to what the batch asks for. With default parameters only five small
[bs] tensors are built and apply_logits_processing() returns at once; every optional edit is
a SparseEntries (see penalties.py) that is None when no request uses it.

Order of logit edits (apply_logits_processing), each only on the rows that asked for it:

    1. repetition_penalty   over prompt + output tokens   l > 0 ? l / p : l * p
    2. frequency/presence   over output tokens            l -= freq * count + presence
    3. logit_bias                                         l += bias
    4. min_new_tokens mask  while len(output) < min_new_tokens: stop_token_ids -> -inf, and
                            the EOS ids too unless ignore_eos (with ignore_eos EOS does not
                            end the request, so there is nothing to hold back; stop_token_ids
                            still would end it, so they stay masked)
    5. grammar mask         constrained rows: tokens their grammar does not allow -> -inf
                            (last, so no edit can bring back a token the grammar excludes)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.constrained.xgrammar_backend import apply_vocab_mask_
from radixserve.sampling.penalties import (
    SparseEntries,
    apply_add_,
    apply_mask_,
    apply_repetition_penalty_,
    apply_subtract_,
    build_frequency_presence,
    build_pairs,
    build_repetition,
)
from radixserve.sampling.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed for a request with `seed` drawing its token number `step` (0-based).

    Pure integer mixing (splitmix64, twice) rather than hash(): identical on every platform
    and process, and nearby (seed, step) pairs give unrelated streams. 63 bits so that
    torch.Generator.manual_seed accepts it everywhere.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & 0x7FFF_FFFF_FFFF_FFFF


def salted_seed(seed: int, salt: int) -> int:
    """Another stream for the same (seed, step): speculative decoding draws a seeded request's
    acceptance tests and a draft model's proposals from streams independent of the one its tokens
    use, and reproducible all the same."""
    return _splitmix64((seed ^ salt) & _MASK64) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class SamplingBatchInfo:
    """Per-step sampling state for a batch of bs requests (row i = request i)."""

    # Greedy rows hold neutral values here (1.0 / 1.0 / vocab_size / 0.0): see is_greedy.
    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32; 1.0 where off
    top_ks: torch.Tensor  # [bs] int64; vocab_size where off
    min_ps: torch.Tensor  # [bs] float32; 0.0 where off
    is_greedy: torch.Tensor  # [bs] bool
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    vocab_size: int
    any_greedy: bool = False
    # Optional logit edits; None when no request in the batch needs them.
    repetition: SparseEntries | None = None  # value = repetition_penalty
    frequency_presence: SparseEntries | None = None  # value = amount to subtract
    logit_bias: SparseEntries | None = None  # value = bias to add
    min_tokens_mask: SparseEntries | None = None  # (row, token) pairs forced to -inf
    # (row, torch generator seed for this step) for non-greedy rows that carry a seed.
    seeded_rows: list[tuple[int, int]] | None = None
    # constrained decoding: xgrammar bitmask [rows, ceil(vocab / 32)] (see ModelWorkerBatch.vocab_mask)
    vocab_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.top_ps.shape[0])

    @property
    def needs_logits_processing(self) -> bool:
        """False for the common case: then apply_logits_processing() is a no-op."""
        return any(
            e is not None
            for e in (self.repetition, self.frequency_presence, self.logit_bias, self.min_tokens_mask,
                      self.vocab_mask)
        )

    @staticmethod
    def needs_history(sampling_params: list[SamplingParams]) -> bool:
        """True if any request needs its generated-token list (penalties, min_new_tokens, seed)."""
        return any(p.needs_penalties or p.min_new_tokens > 0 or p.seed is not None for p in sampling_params)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        sampling_params: list[SamplingParams],
        output_ids: list[list[int]] | None,
        vocab_size: int,
        eos_token_ids: Sequence[int] | int | None,
        device: torch.device | str,
        prompt_ids: list[list[int]] | None = None,
        vocab_mask: torch.Tensor | None = None,
    ) -> SamplingBatchInfo:
        """Derive the batch's tensors.

        output_ids[i]: tokens request i generated so far (its length is the generation step
        used for min_new_tokens and seeds); None means "not tracked" and counts as empty, so
        pass it whenever needs_history() says so, or a seeded request repeats its step-0 draw.
        prompt_ids[i]: request i's prompt, only read for repetition_penalty (None = apply
        repetition_penalty to generated tokens only).
        """
        bs = len(sampling_params)
        device = torch.device(device)
        for name, lists in (("output_ids", output_ids), ("prompt_ids", prompt_ids)):
            if lists is not None and len(lists) != bs:
                raise ValueError(f"{name} has {len(lists)} entries for {bs} requests")
        history: Sequence[Sequence[int]] = output_ids if output_ids is not None else [()] * bs

        greedy = [p.is_greedy for p in sampling_params]
        # Greedy rows take the argmax of the logits, so their temperature and filters are
        # neutral: no division by 0, and they never switch a filter on for the batch.
        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        for p, g in zip(sampling_params, greedy):
            off = g or p.top_k == -1 or p.top_k >= vocab_size
            temps.append(1.0 if g else float(p.temperature))
            top_ps.append(1.0 if g else float(p.top_p))
            top_ks.append(vocab_size if off else p.top_k)
            min_ps.append(0.0 if g else float(p.min_p))
        info = cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(bs, 1),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            need_top_p=any(x < 1.0 for x in top_ps),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(x > 0.0 for x in min_ps),
            vocab_size=vocab_size,
            any_greedy=any(greedy),
        )

        # 1. repetition penalty (prompt + output)
        rows = [i for i, p in enumerate(sampling_params) if p.repetition_penalty != 1.0]
        if rows:
            entries = build_repetition(
                [prompt_ids[i] for i in rows] if prompt_ids is not None else [],
                [history[i] for i in rows],
                rows,
                [sampling_params[i].repetition_penalty for i in rows],
                vocab_size,
            )
            info.repetition = entries.to(device) if len(entries) else None

        # 2. frequency / presence (output only)
        rows = [
            i
            for i, p in enumerate(sampling_params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        if rows:
            entries = build_frequency_presence(
                [history[i] for i in rows],
                rows,
                [sampling_params[i].frequency_penalty for i in rows],
                [sampling_params[i].presence_penalty for i in rows],
                vocab_size,
            )
            info.frequency_presence = entries.to(device) if len(entries) else None

        # 3. logit bias (dict keys are unique, so pairs are too)
        pairs = [
            (i, int(tok), float(bias))
            for i, p in enumerate(sampling_params)
            for tok, bias in p.logit_bias.items()
            if bias != 0 and 0 <= int(tok) < vocab_size
        ]
        if pairs:
            info.logit_bias = build_pairs(pairs).to(device)

        # 4. min_new_tokens: hold back every token that would end the request
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        eos = set(eos_token_ids or ())
        pairs = []  # (row, token, unused value)
        for i, p in enumerate(sampling_params):
            if len(history[i]) < p.min_new_tokens:
                banned = set(p.stop_token_ids) if p.ignore_eos else eos | set(p.stop_token_ids)
                pairs.extend((i, t, 0.0) for t in sorted(banned) if 0 <= t < vocab_size)
        if pairs:
            info.min_tokens_mask = build_pairs(pairs).to(device)

        # Seeds: only rows that actually sample (a greedy row's draw is discarded anyway).
        seeded = [
            (i, step_seed(p.seed, len(history[i])))
            for i, (p, g) in enumerate(zip(sampling_params, greedy))
            if p.seed is not None and not g
        ]
        info.seeded_rows = seeded or None
        info.vocab_mask = vocab_mask
        return info

    # ------------------------------------------------------------------ apply
    def apply_logits_processing(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply penalties, logit_bias and the min_new_tokens mask to logits [bs, vocab].

        Edits in place and returns the same tensor (no copy when nothing applies).
        """
        if self.repetition is not None:
            apply_repetition_penalty_(logits, self.repetition)
        if self.frequency_presence is not None:
            apply_subtract_(logits, self.frequency_presence)
        if self.logit_bias is not None:
            apply_add_(logits, self.logit_bias)
        if self.min_tokens_mask is not None:
            apply_mask_(logits, self.min_tokens_mask)
        if self.vocab_mask is not None:
            apply_vocab_mask_(logits, self.vocab_mask)
        return logits


class SamplingInfoMemo:
    """The last step's SamplingBatchInfo, given again to a step whose rows carry the very same SamplingParams
    objects and nothing that changes from step to step (no token history, prompts or grammar mask: then build()
    is a function of the params alone). A decode stream's steps then build no tensors here: ~0.1 ms of a 6 ms
    batch-1 step on a 2-vCPU Zen 3. The memo holds the params it was built from, so identity cannot be reused by
    a new request's params while it compares them; nothing reads a SamplingBatchInfo's tensors mutably."""

    def __init__(self) -> None:
        self._params: list[SamplingParams] | None = None
        self._info: SamplingBatchInfo | None = None

    def build(self, sampling_params: list[SamplingParams], output_ids: list[list[int]] | None, vocab_size: int,
              eos_token_ids: Sequence[int] | int | None, device: torch.device | str,
              prompt_ids: list[list[int]] | None = None, vocab_mask: torch.Tensor | None = None) -> SamplingBatchInfo:
        static = output_ids is None and prompt_ids is None and vocab_mask is None
        last = self._params
        if (static and last is not None and len(last) == len(sampling_params)
                and all(a is b for a, b in zip(last, sampling_params))):
            assert self._info is not None
            return self._info
        info = SamplingBatchInfo.build(sampling_params, output_ids, vocab_size, eos_token_ids, device, prompt_ids,
                                       vocab_mask)
        self._params, self._info = (list(sampling_params), info) if static else (None, None)
        return info

