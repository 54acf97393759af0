"""Tensor-parallel linear layers (Megatron-style column / row sharding).

    ColumnParallelLinear   W [out, in] split along out:  rank r holds rows [r*out/tp, (r+1)*out/tp)
    RowParallelLinear      W [out, in] split along in:   partial sums, all-reduced
    Merged/QKV variants    several logical matrices stacked along out, each split separately:

        qkv_proj.weight on rank r = [ q rows of r | k rows of r | v rows of r ]

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that slices the full
checkpoint tensor to this rank's part, so a rank only keeps its own shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import ParallelState


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, ps.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices in one GEMM (gate_proj and up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, ps: ParallelState) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ps)
        self.sizes_per_rank = [_divide(s, ps.tp_size, "output features") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        size = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.ps.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM, split by heads. KV heads are replicated when there
    are fewer of them than ranks (GQA with tp_size > num_kv_heads)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, ps: ParallelState
    ) -> None:
        tp = ps.tp_size
        self.num_heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "kv heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tp_size over kv heads")
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, ps)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rank = self.ps.tp_rank
        if shard_id == "q":
            offset, size, src_rank = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_rank = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: unknown shard {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src_rank * size, size))


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.in_per_rank = _divide(in_features, ps.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = lambda p, w, s=None: p.data.copy_(w)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ps.all_reduce(F.linear(x, self.weight))
        # NOTE: bias after the reduce, or it would be added tp_size times.
        return out if self.bias is None else out + self.bias
