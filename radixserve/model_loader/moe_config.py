"""The mixture-of-experts part of a model config: how each MoE architecture spells its experts, and the
one validation of those numbers (ModelConfig.from_hf_config calls it; GGUF configs arrive here translated
to the same HF keys by gguf_moe.py).

    Qwen3-MoE   num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
                decoder_sparse_step, mlp_only_layers (the other layers run a dense MLP of intermediate_size)
    Qwen2-MoE   the same, plus a shared expert of shared_expert_intermediate_size behind a sigmoid gate
    OLMoE       num_experts (alias num_local_experts), the experts' size is intermediate_size, every layer
                sparse, norm_topk_prob (False in every released config)
    Mixtral     num_local_experts, intermediate_size, every layer sparse, always renormalised top-k
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The most experts / top-k a layer may have: the counts in use are far below (Qwen3: 128 / 8, Qwen3-Next 512 /
# 10, DeepSeek-V3 256 / 8, Kimi K2 384 / 8); a config past them is a corrupt or lying file, refused before a
# single [experts, ...] weight is allocated.
MAX_EXPERTS = 4096
MAX_TOP_K = 64


@dataclass(frozen=True)
class MoESpec:
    """How one architecture's config names its experts."""

    experts_keys: tuple[str, ...]  # the expert-count key, in the spellings the architecture's configs use
    size_key: str  # the routed experts' intermediate size
    renormalize: bool | None  # None: read norm_topk_prob (default False); else fixed by the architecture
    shared_expert: bool = False  # a sigmoid-gated shared expert beside the routed ones (Qwen2-MoE)
    sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers choose the sparse layers (Qwen MoE)


@dataclass(frozen=True)
class MoEFields:
    """The ModelConfig fields a MoE config fills (a dense model keeps the defaults)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    moe_layers: tuple[int, ...]


def _int(cfg: dict, key: str, default: Any = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"model config field {key!r} must be an integer, got {value!r}")
    return int(value)


def moe_fields(cfg: dict, spec: MoESpec, num_layers: int) -> MoEFields:
    """The experts of `cfg`, validated: every count positive, top-k within the experts, the sparse layers
    inside the model. Raises ValueError naming the key and its value."""
    key = next((k for k in spec.experts_keys if cfg.get(k) is not None), spec.experts_keys[0])
    experts = _int(cfg, key)
    top_k = _int(cfg, "num_experts_per_tok")
    size = _int(cfg, spec.size_key)
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"model config {key} must be between 1 and {MAX_EXPERTS}, got {experts}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"model config num_experts_per_tok ({top_k}) is above the {MAX_TOP_K} this engine takes")
    if not 1 <= top_k <= experts:
        raise ValueError(f"model config num_experts_per_tok ({top_k}) must be between 1 and {key} ({experts})")
    if size < 1:
        raise ValueError(f"model config {spec.size_key} must be >= 1, got {size}")
    shared = _int(cfg, "shared_expert_intermediate_size", 0) if spec.shared_expert else 0
    if spec.shared_expert and shared < 1:
        raise ValueError(f"model config shared_expert_intermediate_size must be >= 1, got {shared}")
    layers = tuple(range(num_layers))
    if spec.sparse_step:
        step = _int(cfg, "decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"model config decoder_sparse_step must be >= 1, got {step}")
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < num_layers
                                                           for i in dense):
            raise ValueError(f"model config mlp_only_layers must list layer ids in [0, {num_layers}), got {dense!r}")
        # transformers: layer i is sparse when it is not listed and (i + 1) % decoder_sparse_step == 0
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    renormalize = spec.renormalize
    if renormalize is None:
        renormalize = bool(cfg.get("norm_topk_prob", False))
    return MoEFields(experts, top_k, size, renormalize, shared, layers)


MOE_SPECS: dict[str, MoESpec] = {
    # transformers 5 writes Qwen3-MoE's count as num_local_experts, the released configs as num_experts
    "Qwen3MoeForCausalLM": MoESpec(("num_experts", "num_local_experts"), "moe_intermediate_size", None,
                                   sparse_step=True),
    "Qwen2MoeForCausalLM": MoESpec(("num_experts", "num_local_experts"), "moe_intermediate_size", None,
                                   shared_expert=True,
                                   sparse_step=True),
    "OlmoeForCausalLM": MoESpec(("num_experts", "num_local_experts"), "intermediate_size", None),
    "MixtralForCausalLM": MoESpec(("num_local_experts", "num_experts"), "intermediate_size", True),
}
