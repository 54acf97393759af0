"""Tiny random mixture-of-experts models made with transformers (shared by the MoE tests): each MoE
architecture, with router weights large enough that every token's top-k is decisive (no near-ties between
our float32 sums and transformers'), experts large enough that a wrong expert shows in the logprobs."""

from __future__ import annotations

import torch

from tests.models.test_architectures import BASE

E = 8  # experts per layer
HOT, DEAD = 0, E - 1  # the skewed variant routes every token to HOT and none to DEAD

# name -> (config class, model class, config fields)
MOE_ARCHITECTURES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": E, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True}),
    # a dense layer among the sparse ones (mlp_only_layers), no renormalisation
    "qwen3_moe_dense_layer": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "mlp_only_layers": [1]}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": E, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": E, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16}),
}


def make_moe_model(arch: str, path, skewed: bool = False, **overrides) -> torch.nn.Module:
    """The tiny transformers model of `arch`, saved to `path` in transformers' original (per-expert) format.

    skewed: every token's hidden state gets a large constant component on dim 0 (through the embeddings,
    carried by the residual stream), and every router reads it: +1 for expert HOT, -1 for DEAD, so HOT is
    in every token's top-k and DEAD in none."""
    import transformers

    cfg_name, model_name, extra = MOE_ARCHITECTURES[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.normal_(0, 1.0)  # decisive routing
            elif ".experts." in name:
                p.normal_(0, 0.1)
        if skewed:
            model.model.embed_tokens.weight[:, 0] += 3.0
            for layer in model.model.layers:
                router = layer.mlp.gate.weight
                router[:, 0] = 0.0
                router[HOT, 0], router[DEAD, 0] = 2.0, -2.0
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_expert_counts(model, tokens: list[int]) -> dict[int, list[int]]:
    """Tokens per expert in each sparse layer of transformers' own forward over `tokens` (its router
    logits, its top-k): the oracle for our expert load."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    counts = {}
    for layer_id, logits in zip(sparse, out.router_logits):
        ids = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices
        counts[layer_id] = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    return counts
