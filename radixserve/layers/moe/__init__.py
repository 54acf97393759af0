"""Mixture-of-experts layers: the router (router.py), the stacked expert weights (experts.py), the
token-grouped expert GEMMs (fused_experts.py), the decoder layer's MoE MLP (sparse_moe_block.py) and the
per-step expert load (expert_load.py). docs/moe.md is the user-facing page."""

from radixserve.layers.moe.expert_load import ExpertLoad
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.moe.fused_experts import fused_experts
from radixserve.layers.moe.router import TopKRouting, softmax_topk
from radixserve.layers.moe.sparse_moe_block import SparseMoeBlock

__all__ = ["ExpertLoad", "FusedMoE", "SparseMoeBlock", "TopKRouting", "fused_experts", "softmax_topk"]
