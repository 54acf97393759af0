"""SparseMoeBlock: the MLP of a mixture-of-experts decoder layer.

    router     logits = x W_g^T (replicated on every rank, float32), softmax top-k (router.py)
    experts    the top-k experts' gated MLPs, weighted and summed: on their low-bit blocks through
               csrc/fused_experts.cpp when the step runs low-bit, else in PyTorch (fused_experts.py);
               each rank its experts (expert parallel) and its slice of their intermediate dimension,
               then one all-reduce
    shared     Qwen2-MoE: + sigmoid(x w_s^T) * shared_expert(x), a dense gated MLP every token runs

transformers' Qwen3MoeSparseMoeBlock / OlmoeSparseMoeBlock / Qwen2MoeSparseMoeBlock / MixtralSparseMoeBlock
compute exactly this; the architectures differ only in the config numbers (ModelConfig.num_experts ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.activation import gated_activation, kernel_activation_id
from radixserve.layers.kernel_mode import step_kernels
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.moe.expert_load import ExpertLoad
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.moe.fused_experts import fused_experts
from radixserve.layers.moe.router import TopKRouting, softmax_topk

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_loader.model_config import ModelConfig

class SharedExpertMLP(nn.Module):
    """down(act(gate(x)) * up(x)) of the shared expert's own size, tensor-parallel like the dense MLP."""

    def __init__(self, hidden: int, inter: int, act: str, ps: ParallelState) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter] * 2, False, ps)
        self.down_proj = RowParallelLinear(inter, hidden, False, ps)
        self.act = gated_activation(act)

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch | None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, forward_batch)), forward_batch)


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
        self.kernel_act = kernel_activation_id(cfg.hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                                 cfg.hidden_act, ps)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
        self.expert_load: ExpertLoad | None = None  # the model's accumulator (observability)

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        routing = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        mode = step_kernels(forward_batch)
        out, counts = self._experts(x, routing, mode.low_bit_ops(x.shape[0]), mode.batch_invariant)
        out = self.ps.all_reduce(out)
        if self.expert_load is not None:
            self.expert_load.add(self.layer_id, counts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, forward_batch)
        return out

    def _experts(self, x: torch.Tensor, routing: TopKRouting, ops: Any,
                 batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' share of the output, and the step's tokens per (global) expert. `ops`: the
        low-bit kernels when this step runs them (KernelMode.low_bit_ops), else None."""
        ex = self.experts
        if ex.low_bit is not None and ops is not None and x.dtype == torch.float32:
            w13, w2 = ex.low_bit
            out = torch.empty_like(x)
            ops.fused_experts(x.contiguous(), routing.ids.contiguous(), routing.weights.contiguous(),
                              ex.expert_offset, w13.kind, w13.n, w13.data, w13.d, w13.m, w2.kind, w2.data,
                              w2.d, w2.m, self.kernel_act, out)
            return out, torch.bincount(routing.ids.reshape(-1), minlength=self.num_experts)
        if ex.w13 is None or ex.w2 is None:
            raise RuntimeError("these experts keep only their low-bit copy (their float weights were released), "
                               "but the step did not run in a low-bit mode")
        return fused_experts(x, ex.w13, ex.w2, routing, self.act, self.num_experts, ex.expert_offset, batch_invariant)
