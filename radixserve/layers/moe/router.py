"""The router: logits -> the top-k experts of every token and their weights.

Softmax over all experts in float32, then the k largest probabilities (transformers' order: softmax
first, top-k of the probabilities, which selects the same experts as top-k of the logits), optionally
renormalised to sum to 1 (`norm_topk_prob`: Qwen3-MoE and Mixtral yes, OLMoE and Qwen1.5-MoE no)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopKRouting:
    """Which experts each token goes to, and with what weight."""

    weights: torch.Tensor  # [tokens, k] float32
    ids: torch.Tensor  # [tokens, k] int64, expert ids in [0, num_experts)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> TopKRouting:
    """`router_logits` [tokens, experts] -> TopKRouting. Raises ValueError when k exceeds the experts."""
    experts = router_logits.shape[-1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top-k {top_k} must be between 1 and the number of experts ({experts})")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKRouting(weights, ids)
