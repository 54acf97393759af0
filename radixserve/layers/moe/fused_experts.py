"""fused_experts: every token through its top-k experts' gated MLPs, weighted and summed, in plain
PyTorch (the reference the CPU kernel is checked against, and the CUDA path).

The step's (token, slot) pairs are sorted by expert once, so each selected expert's weights are read
once per step however many tokens chose it (one [n_e, hidden] x [hidden, 2 * inter] GEMM per expert,
not n_e matrix-vector products); experts no token chose are never touched. Returns the per-expert token
counts too, which is the step's expert load (observability)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.batch_invariant import tiled_rows
from radixserve.layers.moe.router import TopKRouting


def expert_order(routing: TopKRouting, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat pair indices sorted by expert, their token ids, tokens per expert [num_experts]).
    Pair p is token p // k's slot p % k; the sort is stable, so each expert sees its tokens in order."""
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // routing.ids.shape[1], counts


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: TopKRouting, act: nn.Module,
    num_experts: int, expert_offset: int = 0, batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k weight_k * down_e(act(gate_e(x)) * up_e(x)) for the experts e this rank holds.

    x [tokens, hidden]; w13 [local experts, 2 * inter, hidden] (gate rows then up rows, as act() splits
    them); w2 [local experts, hidden, inter]. The local experts are global ids expert_offset ..
    expert_offset + len(w13); pairs routed elsewhere contribute nothing here. Returns (out [tokens, hidden]
    in x's dtype, tokens per global expert [num_experts] int64: every expert's, whoever holds it).
    batch_invariant (--enable-deterministic-inference): each expert's GEMMs in fixed row tiles, so a token's
    result does not depend on how many others chose its experts (a token's experts add in expert order)."""
    local = w13.shape[0]
    order, tokens, counts = expert_order(routing, num_experts)
    flat_weights = routing.weights.reshape(-1)
    out = torch.zeros_like(x)
    start = int(counts[:expert_offset].sum())
    for e, n in enumerate(counts[expert_offset : expert_offset + local].tolist()):
        if n == 0:
            continue
        pairs = order[start : start + n]
        rows = tokens[start : start + n]
        start += n
        w_up, w_down = w13[e], w2[e]
        if batch_invariant:
            h = act(tiled_rows(lambda r: F.linear(r, w_up), x[rows]))
            y = tiled_rows(lambda r: F.linear(r, w_down), h)
        else:
            y = F.linear(act(F.linear(x[rows], w_up)), w_down)
        y = y * flat_weights[pairs].unsqueeze(1).to(x.dtype)
        out.index_add_(0, rows, y)
    return out, counts
