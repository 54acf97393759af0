"""Sampler: processed logits -> next token ids, one per request.

    logits [bs, vocab]
      | SamplingBatchInfo.apply_logits_processing   penalties, logit_bias, min_new_tokens
      |-- all greedy? ------------------------------> argmax                          (fast path)
      | / temperature, exp(x - max)                  probs [bs, vocab] float32, unnormalised
      | filter_probs_: top_k -> top_p -> min_p       zero what a request excludes
      | sample_from_probs: inverse CDF, 2 uniforms per row
      v
    next ids [bs] int64 (greedy rows replaced by the argmax of the processed logits)

Why inverse-CDF sampling rather than the exponential race or torch.multinomial: it needs two
random numbers per *row* instead of one per (row, token). On the CPU, drawing bs * vocab
exponentials costs several times the softmax itself, while a row's two uniforms are free.
A request with a seed takes its uniforms from a CPU generator seeded by (seed, step), so its
tokens depend on nothing else in the batch (nor on the device). The CDF is two-level, first
over chunks of _CHUNK tokens and then inside the chosen chunk, accumulated in float64: one flat
float32 cumsum over 150k tokens would round every tail token's share to a multiple of ~6e-8.

Filters are thresholds: a row keeps every token whose prob is >= its cut-off. So the result
does not depend on how a sort breaks ties (tokens tied at the boundary all stay), and on the
CPU top_k / top_p are settled among the _CANDIDATES most probable tokens (a topk, ~10x cheaper
than sorting the vocabulary), widening 16x at a time, up to a full sort, only for the rows
whose cut-off lies beyond them.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.layers.cpu_kernel_layer import CpuKernelLayer
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoMemo

_CANDIDATES = 256
_CHUNK = 1024


# ---------------------------------------------------------------------- filtering
def _cutoff_from_sorted(
    vals: torch.Tensor,
    total: torch.Tensor,
    top_ks: torch.Tensor | None,
    top_ps: torch.Tensor | None,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top_k/top_p cut-off from the K largest probs of each row, sorted descending.

    vals [bs, K]; total [bs] = sum of the row's probs. Returns (cutoff [bs], complete [bs]):
    complete is False where the answer may need tokens beyond the K given.
    """
    bs, k_cand = vals.shape
    device = vals.device
    ranks = torch.arange(k_cand, device=device)  # [K]
    if top_ks is None:
        top_ks = torch.full((bs,), vocab, dtype=torch.int64, device=device)
    kk = top_ks.clamp(max=vocab)  # [bs]
    k_on = kk < vocab
    in_k = ranks[None, :] < kk[:, None]  # [bs, K]
    vals_k = vals.masked_fill(~in_k, 0.0)  # [bs, K]
    last = kk - 1  # [bs] rank of the last token top_k keeps
    complete = ~k_on | (kk <= k_cand)
    p_on = torch.zeros_like(k_on)
    if top_ps is not None:
        p_on = top_ps < 1.0  # top_p == 1 is off outright: no rounding can then drop a token
        # top_p measures against what top_k left (renormalised), or the whole row.
        mass = torch.where(k_on, vals_k.sum(dim=-1), total)  # [bs]
        exclusive = vals_k.cumsum(dim=-1) - vals_k  # [bs, K] mass ranked above each token
        # A token stays iff the tokens above it hold < top_p of the mass: the smallest prefix
        # reaching top_p. Rank 0 (exclusive 0 < top_p * mass) always stays.
        n_keep = ((exclusive < (top_ps * mass)[:, None]) & in_k).sum(dim=-1)  # [bs]
        last = torch.where(p_on, n_keep - 1, last)
        complete &= ~p_on | (kk <= k_cand) | (n_keep < k_cand)
    cutoff = vals.gather(1, last.clamp(0, k_cand - 1)[:, None]).squeeze(1)  # [bs]
    cutoff = torch.where(k_on | p_on, cutoff, torch.zeros_like(cutoff))
    return cutoff, complete | (k_cand >= vocab)


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def _top_k_top_p_cutoff(
    probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None, candidates: int
) -> torch.Tensor:
    """[bs] top_k/top_p cut-offs: try the `candidates` largest probs of every row, then 16x
    as many for the rows they did not settle, and so on up to a full sort."""
    vocab = probs.shape[-1]
    total = probs.sum(dim=-1)  # [bs]
    cutoff = torch.empty(0)
    rows: torch.Tensor | None = None  # unsettled rows; None = all of them
    k = candidates
    while True:
        k = min(k, vocab)
        sub = probs if rows is None else probs[rows]
        # topk is ~10x cheaper than a sort on the CPU while k << vocab
        vals = sub.topk(k, dim=-1).values if k < vocab else sub.sort(dim=-1, descending=True).values
        found, done = _cutoff_from_sorted(
            vals, _rows(total, rows), _rows(top_ks, rows), _rows(top_ps, rows), vocab
        )
        if rows is None:
            cutoff = found
            rows = torch.arange(probs.shape[0], device=probs.device)
        else:
            cutoff[rows] = found
        if k >= vocab:  # settled by construction; spares accelerators a host sync too
            return cutoff
        rows = rows[~done]
        if rows.numel() == 0:
            return cutoff
        k *= 16


def filter_probs_(
    probs: torch.Tensor,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    candidates: int | None = None,
) -> torch.Tensor:
    """Zero, in place, the tokens each row's top_k / top_p / min_p excludes; returns probs.

    probs [bs, vocab] >= 0, not necessarily normalised (every rule is scale-free);
    top_ks [bs] int64 (>= vocab = off), top_ps [bs] (1.0 = off), min_ps [bs] (0.0 = off);
    None switches a filter off for the whole batch. Applied in order, each on the
    (implicitly renormalised) survivors of the previous one:

      top_k  keep the k most probable tokens;
      top_p  keep the smallest most-probable set whose share of the remaining mass is
             >= top_p (always at least one token);
      min_p  keep tokens with prob >= min_p * max prob (max is unchanged by the above).
    Tokens tied with the last one kept also stay. candidates: how many top tokens to try
    before sorting a row fully (default: _CANDIDATES on the CPU; on accelerators, where a
    sort is cheap and a fallback would cost a host sync, always sort).
    """
    vocab = probs.shape[-1]
    cutoff: torch.Tensor | None = None  # [bs]
    if top_ks is not None or top_ps is not None:
        if candidates is None:
            candidates = _CANDIDATES if probs.device.type == "cpu" else vocab
        cutoff = _top_k_top_p_cutoff(probs, top_ks, top_ps, candidates)
    if min_ps is not None:
        min_cut = min_ps * probs.max(dim=-1).values  # [bs]
        cutoff = min_cut if cutoff is None else torch.maximum(cutoff, min_cut)
    if cutoff is None:
        return probs
    return probs.masked_fill_(probs < cutoff[:, None], 0.0)


# ---------------------------------------------------------------------- sampling
def draw_uniforms(
    batch_size: int, seeded_rows: list[tuple[int, int]] | None, device: torch.device | str
) -> torch.Tensor:
    """[bs, 2] float64 uniforms in [0, 1): global RNG, except seeded rows (row, seed), which
    come from a CPU generator seeded with their seed alone."""
    u = torch.rand(batch_size, 2, dtype=torch.float64, device=device)
    if seeded_rows:
        rows = [row for row, _ in seeded_rows]
        seeded = torch.stack(
            [
                torch.rand(2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
                for _, seed in seeded_rows
            ]
        )  # [r, 2]
        u[rows] = seeded.to(u.device)
    return u


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j of each row with probability weights[j] / sum(weights). weights [bs, n]
    float64 >= 0, u [bs] in [0, 1) -> [bs] int64. A zero weight is never picked."""
    cum = weights.cumsum(dim=-1)  # [bs, n]
    total = cum[:, -1:]  # [bs, 1]
    # First index whose cumulative weight exceeds u * total: a zero weight never does.
    idx = torch.searchsorted(cum, u[:, None] * total, right=True).squeeze(1)  # [bs]
    # u * total may round up to total; then take the index where cum reaches total,
    # which carries positive weight.
    return torch.minimum(idx, (cum < total).sum(dim=-1))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of (unnormalised, non-negative) probs [bs, vocab] -> [bs] int64,
    using uniforms [bs, 2] (see draw_uniforms): column 0 picks a chunk of _CHUNK tokens by its
    mass, column 1 a token inside it."""
    bs, vocab = probs.shape
    size = min(_CHUNK, vocab)
    n_full = vocab // size
    parts = [probs[:, : n_full * size].view(bs, n_full, size).sum(dim=-1)]  # [bs, n_full]
    if vocab % size:
        parts.append(probs[:, n_full * size :].sum(dim=-1, keepdim=True))  # [bs, 1]
    chunk_mass = torch.cat(parts, dim=1).to(torch.float64)  # [bs, n_chunks]
    chunk = _inverse_cdf(chunk_mass, uniforms[:, 0])  # [bs]
    cols = chunk[:, None] * size + torch.arange(size, device=probs.device)  # [bs, size]
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).to(torch.float64)  # [bs, size]
    inside = inside.masked_fill(cols >= vocab, 0.0)  # the last chunk may be short
    return chunk * size + _inverse_cdf(inside, uniforms[:, 1])


def _weights(x: torch.Tensor, info: SamplingBatchInfo, row: int | None) -> torch.Tensor:
    """Temperature, softmax weights (unnormalised) and filters for processed logits x [n, vocab]
    (edited in place and returned): all rows of the batch (row None), or x = the batch's row `row`."""
    rows = slice(None) if row is None else slice(row, row + 1)
    # Greedy rows hold temperature 1.0, so this never divides by zero.
    x.div_(info.temperatures[rows])
    # exp(x - max) is softmax without its normalisation, which nothing below needs (the
    # filters are scale-free, the sampler takes weights); in place saves two passes.
    probs = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # [n, vocab]
    if info.need_top_k or info.need_top_p or info.need_min_p:
        filter_probs_(
            probs,
            info.top_ks[rows] if info.need_top_k else None,
            info.top_ps[rows] if info.need_top_p else None,
            info.min_ps[rows] if info.need_min_p else None,
        )
    return probs


def _draw(x: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor, row: int | None) -> torch.Tensor:
    """The inverse-CDF draw from _weights(x, info, row) -> [n] int64."""
    return sample_from_probs(_weights(x, info, row), uniforms)  # [n]


# ---------------------------------------------------------------------- module
class Sampler(CpuKernelLayer):
    """Turns the last-position logits of each request into its next token id.

    batch_invariant: the runner's --enable-deterministic-inference (layers/batch_invariant.py): each row
    is drawn as a batch of one."""

    def __init__(self, batch_invariant: bool = False, cpu_ops: Any = None) -> None:
        super().__init__()
        self.batch_invariant = batch_invariant
        # the runner's C++ kernels (the ones its layers got), for greedy_argmax; None: torch.argmax
        self.cpu_ops = cpu_ops if cpu_ops is not None and hasattr(cpu_ops, "greedy_argmax") else None
        # the runner's steps build their SamplingBatchInfo through it (ForwardBatch.init_new): a decode stream's
        # steps reuse one
        self.info_memo = SamplingInfoMemo()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, -1), the greedy rows' tokens; through the C++ kernel (the same index: the first
        maximum, the first NaN) for float32 rows on CPU, ~8x faster than torch's over a 49,152 vocabulary."""
        ops = self.cpu_ops
        if (ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.shape[1] > 0 and logits.stride(1) == 1):
            return ops.greedy_argmax(logits)
        return torch.argmax(logits, dim=-1)

    def forward(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """logits [bs, vocab] -> next token ids [bs] int64. `logits` itself is left untouched
        (the caller may still want raw logprobs); all work happens on one float32 copy."""
        info = sampling_info
        if info.all_greedy and not info.needs_logits_processing:
            return self.argmax(logits)
        x = logits.to(torch.float32, copy=True)  # [bs, vocab]
        info.apply_logits_processing(x)
        if info.all_greedy:
            return self.argmax(x)

        greedy_ids = self.argmax(x) if info.any_greedy else None  # [bs]
        uniforms = draw_uniforms(x.shape[0], info.seeded_rows, x.device)  # [bs, 2]
        if self.batch_invariant and x.shape[0] > 1:
            # Deterministic inference: each row is sampled as a batch of one, i.e. by exactly the
            # computation it gets alone (a [bs, vocab] sum splits one row across threads only
            # when bs is small, so batched sampling is not bit-for-bit batch-invariant).
            next_ids = torch.cat([_draw(x[i : i + 1], info, uniforms[i : i + 1], i) for i in range(x.shape[0])])
        else:
            next_ids = _draw(x, info, uniforms, None)  # [bs]
        if greedy_ids is not None:
            next_ids = torch.where(info.is_greedy, greedy_ids, next_ids)
        return next_ids

    def probs(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """The distribution forward() draws each row from, normalised: [bs, vocab] float32 (a greedy
        row is one-hot at its argmax). Speculative decoding needs it explicitly: a draft model's q,
        the target's p in the rejection rule (layers/rejection_sampler.py)."""
        info = sampling_info
        x = logits.to(torch.float32, copy=True)  # [bs, vocab]
        info.apply_logits_processing(x)
        greedy_ids = self.argmax(x) if info.any_greedy else None  # [bs]
        if self.batch_invariant and x.shape[0] > 1:  # per row, as forward() does
            probs = torch.cat([_weights(x[i : i + 1], info, i) for i in range(x.shape[0])])
        else:
            probs = _weights(x, info, None)
        probs.div_(probs.sum(dim=-1, keepdim=True))
        if greedy_ids is not None:
            rows = info.is_greedy.nonzero().squeeze(1)
            probs[rows] = 0.0
            probs[rows, greedy_ids[rows]] = 1.0
        return probs

    def sample_with_probs(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [bs], probs [bs, vocab]): each row drawn from exactly the probs returned with it."""
        probs = self.probs(logits, sampling_info)
        uniforms = draw_uniforms(probs.shape[0], sampling_info.seeded_rows, probs.device)  # [bs, 2]
        return sample_from_probs(probs, uniforms), probs
