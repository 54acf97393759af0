"""QK-norm over the whole q / k projection (OLMoE), not per head: with tensor parallelism each rank holds
some heads, so the mean square is all-reduced across the TP ranks first. Per-head QK-norm (Qwen3, Gemma 3)
needs none of this: a head never straddles ranks.

Replicated KV heads (tp_size > kv heads) are counted once per replica in both the sum and the element
count, so sum(all ranks' squares) / (tp_size * local width) is still the true mean."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import QKVParallelLinear


class ShardedRMSNorm(nn.Module):
    """RMSNorm of a width split across the TP ranks; this rank's weight is rows start .. start + width."""

    def __init__(self, width: int, start: int, eps: float, ps: ParallelState) -> None:
        super().__init__()
        self.ps, self.start, self.eps = ps, start, eps
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded[self.start : self.start + param.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sq = x.float().pow(2).sum(-1, keepdim=True)
        mean = self.ps.all_reduce(sq) / (x.shape[-1] * self.ps.tp_size)
        return (x.float() * torch.rsqrt(mean + self.eps)).to(x.dtype) * self.weight


def full_width_qk_norms(qkv: QKVParallelLinear, eps: float, ps: ParallelState) -> tuple[nn.Module, nn.Module]:
    """(q norm, k norm) over this rank's whole q and k: plain RMSNorms on one rank (the C++ kernel takes
    them), ShardedRMSNorm pieces cut like qkv_proj's q and k rows otherwise."""
    if ps.tp_size == 1:
        return RMSNorm(qkv.q_size, eps), RMSNorm(qkv.kv_size, eps)
    (_, q_start, q_len, _), (_, k_start, k_len, _) = qkv.tp_slice("q"), qkv.tp_slice("k")
    return ShardedRMSNorm(q_len, q_start, eps, ps), ShardedRMSNorm(k_len, k_start, eps, ps)
