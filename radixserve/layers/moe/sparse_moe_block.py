"""SparseMoeBlock: the MLP of a mixture-of-experts decoder layer.

    router     logits = x W_g^T (replicated on every rank, float32), softmax top-k (router.py)
    experts    the top-k experts' gated MLPs, weighted and summed (fused_experts.py), each rank its
               slice of every expert's intermediate dimension, then one all-reduce
    shared     Qwen2-MoE: + sigmoid(x w_s^T) * shared_expert(x), a dense gated MLP every token runs

transformers' Qwen3MoeSparseMoeBlock / OlmoeSparseMoeBlock / Qwen2MoeSparseMoeBlock / MixtralSparseMoeBlock
compute exactly this; the architectures differ only in the config numbers (ModelConfig.num_experts ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.activation import gated_activation
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.moe.expert_load import ExpertLoad
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.moe.fused_experts import fused_experts
from radixserve.layers.moe.router import softmax_topk

if TYPE_CHECKING:
    from radixserve.model_loader.model_config import ModelConfig


class SharedExpertMLP(nn.Module):
    """down(act(gate(x)) * up(x)) of the shared expert's own size, tensor-parallel like the dense MLP."""

    def __init__(self, hidden: int, inter: int, act: str, ps: ParallelState) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter] * 2, False, ps)
        self.down_proj = RowParallelLinear(inter, hidden, False, ps)
        self.act = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.layer_id = layer_id
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router, never quantised
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, ps)
        self.act = gated_activation(cfg.hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                                 cfg.hidden_act, ps)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
        self.expert_load: ExpertLoad | None = None  # the model's accumulator (observability)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        out, counts = fused_experts(x, self.experts.w13, self.experts.w2, routing, self.act, self.num_experts)
        out = self.ps.all_reduce(out)
        if self.expert_load is not None:
            self.expert_load.add(self.layer_id, counts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
