"""RejectionSampler: TARGET_VERIFY's sampling: how many of each request's drafts it keeps, and the token
that follows them.

Rows of one request with k drafts (the verify forward computes them all at once):

    row j          0          1          ...   k
    input          t_last     d_1              d_k
    logits -> p_j  next token after the verified tokens + d_1 .. d_j
    checks         d_1        d_2              (bonus: nothing left to check)

Every row is first sampled exactly as plain decoding samples that step (Sampler, with the request's
penalties / logit_bias / min_new_tokens computed over a history that includes d_1 .. d_j, its
temperature, top-k / top-p / min-p, and its seed's stream at that step): t_j ~ p_j. Then, position by
position, the standard speculative rule (Leviathan et al. 2023; Chen et al. 2023): keep draft x with
probability min(1, p_j(x) / q_j(x)), and at the first rejection output a token from
normalize(max(0, p_j - q_j)). The run ends there; when all k drafts are kept, t_k is the bonus token.
The tokens produced are distributed exactly as sequential sampling from the target.

  point-mass drafts (n-gram lookup, a greedy draft model: q = delta(x)): keep x iff t_j == x. That is
      the rule itself: P(t_j == x) = p_j(x) = min(1, p_j(x) / 1), and a rejected position outputs t_j,
      which is p_j restricted to tokens != x, i.e. normalize(max(0, p_j - q)). Realised with the very
      uniforms plain decoding draws, a seeded request gets the tokens it gets without speculation, and
      a greedy one (t_j = argmax) the longest draft prefix matching the target's argmax plus its next.
  sampled drafts (a draft model drawing x ~ q_j): keep x iff u * q_j(x) < p_j(x), u uniform from its
      own stream (independent of x and of t_j); on rejection the residual draw.
"""

from __future__ import annotations

import torch

from radixserve.layers.sampler import Sampler, draw_uniforms, sample_from_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo, salted_seed

# Streams of a seeded row besides its token stream (sampling_batch_info.salted_seed).
ACCEPT_SALT = 0x5EC0_ACCE_9700_0001
RESIDUAL_SALT = 0x5EC0_0E51_D0A1_0002


def _salted(seeded_rows: list[tuple[int, int]] | None, salt: int) -> list[tuple[int, int]] | None:
    return [(row, salted_seed(seed, salt)) for row, seed in seeded_rows] if seeded_rows else None


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(0, p - q) per row ([r, vocab], unnormalised: the sampler
    takes weights)."""
    residual = (p - q).clamp_(min=0.0)
    empty = ~(residual.sum(dim=-1) > 0)  # p == q up to rounding: the rejection had probability ~0
    if empty.any():
        residual[empty] = p[empty]
    return residual


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, input_ids: list[int],
                 draft_lens: list[int], draft_probs: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[int]]:
        """logits [n, vocab] (n = sum(1 + k_i)), info with one row per verified position, input_ids [n]
        (row j + 1's input is the draft row j checks), draft_probs[i] [k_i, vocab] or None (point mass).
        Returns (tokens [n]: the first accept_len + 1 rows of each request are what it produced,
        accept_lens [bs])."""
        ids = self.sampler(logits, info)  # [n] t_j: each row sampled as plain decoding would
        starts, start = [], 0
        for k in draft_lens:
            starts.append(start)
            start += k + 1
        explicit = [i for i, q in enumerate(draft_probs) if q is not None and draft_lens[i] > 0]
        rejected_at: dict[int, int] = {}  # request -> its first rejected position (a residual draw there)
        if explicit:
            rejected_at = self._sampled_drafts(logits, info, input_ids, ids, explicit, starts, draft_lens,
                                               draft_probs)
        tokens, accept_lens = ids.tolist(), []
        for i, (s, k) in enumerate(zip(starts, draft_lens)):
            if i in rejected_at:
                accept_lens.append(rejected_at[i])
                continue
            a = 0
            while a < k and tokens[s + a] == input_ids[s + a + 1]:
                a += 1
            accept_lens.append(a)
        return ids, accept_lens

    def _sampled_drafts(self, logits: torch.Tensor, info: SamplingBatchInfo, input_ids: list[int],
                        ids: torch.Tensor, explicit: list[int], starts: list[int], draft_lens: list[int],
                        draft_probs: list[torch.Tensor | None]) -> dict[int, int]:
        """The rule for drafts drawn from q, all such requests at once: writes the kept drafts and the
        residual draws into ids; returns {request: first rejected position} for those that had one."""
        p = self.sampler.probs(logits, info)  # [n, vocab], what each t_j was drawn from
        n, device = p.shape[0], p.device
        u_acc = draw_uniforms(n, _salted(info.seeded_rows, ACCEPT_SALT), device)[:, 0]  # [n]
        u_res = draw_uniforms(n, _salted(info.seeded_rows, RESIDUAL_SALT), device)  # [n, 2]
        # the draft rows of these requests: row r checks draft x = input of row r + 1 against p[r]
        rows = torch.tensor([starts[i] + j for i in explicit for j in range(draft_lens[i])], device=device)  # [m]
        pos = torch.tensor([j for i in explicit for j in range(draft_lens[i])], device=device)  # [m] j
        seg = torch.tensor([e for e, i in enumerate(explicit) for _ in range(draft_lens[i])], device=device)  # [m]
        x = torch.tensor(input_ids, dtype=torch.int64, device=device)[rows + 1]  # [m]
        q = torch.cat([draft_probs[i].to(device, torch.float32) for i in explicit])  # [m, vocab]
        arange_m = torch.arange(rows.numel(), device=device)
        keep = u_acc[rows].double() * q[arange_m, x].double() < p[rows, x].double()  # [m]
        # kept drafts per request = its first rejected position (its draft count if none)
        k_of = torch.tensor([draft_lens[i] for i in explicit], device=device)  # [e]
        first_reject = k_of.clone().scatter_reduce_(0, seg, torch.where(keep, k_of[seg], pos), "amin")  # [e]
        kept_row = pos < first_reject[seg]  # [m]
        ids[rows[kept_row]] = x[kept_row]
        rej = (first_reject < k_of).nonzero().squeeze(1)  # [r] requests with a rejection
        if rej.numel():
            first_row = torch.tensor([starts[i] for i in explicit], device=device)  # [e]
            q_offset = torch.cumsum(k_of, 0) - k_of  # [e] where each request's q rows start
            at = first_row[rej] + first_reject[rej]  # [r] the rows that draw from the residual
            residual = residual_distribution(p[at], q[q_offset[rej] + first_reject[rej]])  # [r, vocab]
            ids[at] = sample_from_probs(residual, u_res[at])
        return {explicit[e]: int(first_reject[e]) for e in rej.tolist()}
