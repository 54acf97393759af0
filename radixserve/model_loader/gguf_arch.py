"""One record per llama.cpp architecture: how its GGUF metadata becomes an HF config, how its tensor names
become HF parameter names, and which tensor transforms undo what convert_hf_to_gguf.py did.

llama.cpp's keys are the reference (`{arch}.attention.sliding_window`, `{arch}.attention.key_length`,
`{arch}.rope.freq_base`, ...); where llama.cpp hard-codes a trait instead of writing it (Gemma 3's
five-local-to-one-global pattern and its local RoPE base), the record says so, as transformers' GGUF
loader (the oracle) also assumes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.model_loader.gguf_moe import (
    MOE_BLOCK,
    MOE_STEMS,
    SHARED_EXPERT_BLOCK,
    SHARED_EXPERT_STEMS,
    moe_config,
)

Meta = Callable[[str, Any], Any]  # meta(key without the "{arch}." prefix, default) -> value

# Per-block tensor stem -> HF sub-module, for the Llama baseline. Norms and the MLP carry no bias in the
# architectures we serve, so a GGUF that has one is refused rather than silently mis-loaded.
_LLAMA_BLOCK: dict[str, tuple[str, frozenset[str]]] = {
    "attn_norm": ("input_layernorm", frozenset({"weight"})),
    "ffn_norm": ("post_attention_layernorm", frozenset({"weight"})),
    "attn_q": ("self_attn.q_proj", frozenset({"weight", "bias"})),
    "attn_k": ("self_attn.k_proj", frozenset({"weight", "bias"})),
    "attn_v": ("self_attn.v_proj", frozenset({"weight", "bias"})),
    "attn_output": ("self_attn.o_proj", frozenset({"weight", "bias"})),
    "ffn_gate": ("mlp.gate_proj", frozenset({"weight"})),
    "ffn_up": ("mlp.up_proj", frozenset({"weight"})),
    "ffn_down": ("mlp.down_proj", frozenset({"weight"})),
}
_W = frozenset({"weight"})
_QK_NORM = {"attn_q_norm": ("self_attn.q_norm", _W), "attn_k_norm": ("self_attn.k_norm", _W)}
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_norm": ("pre_feedforward_layernorm", _W),
    "post_attention_norm": ("post_attention_layernorm", _W),
    "post_ffw_norm": ("post_feedforward_layernorm", _W),
}
_PHI3_BLOCK = {
    "attn_norm": ("input_layernorm", _W),
    "ffn_norm": ("post_attention_layernorm", _W),
    "attn_qkv": ("self_attn.qkv_proj", frozenset({"weight", "bias"})),
    "attn_output": ("self_attn.o_proj", frozenset({"weight", "bias"})),
    "ffn_up": ("mlp.gate_up_proj", _W),  # gate and up fused, gate first (as HF's gate_up_proj)
    "ffn_down": ("mlp.down_proj", _W),
}


def _no_extra(meta: Meta, cfg: dict) -> dict:
    return {}


def _sliding_everywhere(meta: Meta, cfg: dict) -> dict:
    window = meta("attention.sliding_window", None)
    return {} if window is None else {"sliding_window": int(window)}


def _gemma3(meta: Meta, cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    # llama.cpp: every sixth layer global (set_swa_pattern(6)); the local layers' RoPE base is 10,000
    pattern = int(meta("attention.sliding_window_pattern", 6))
    return {
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "attn_logit_softcapping": meta("attn_logit_softcapping", None),
    }


def _gemma2(meta: Meta, cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    return {
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "query_pre_attn_scalar": cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "attn_logit_softcapping": meta("attn_logit_softcapping", None),
    }


def _phi3(meta: Meta, cfg: dict) -> dict:
    extra = _sliding_everywhere(meta, cfg)
    rot = meta("rope.dimension_count", None)
    if rot is not None and int(rot) != cfg["head_dim"]:
        extra["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
    return extra


def _llama(meta: Meta, cfg: dict) -> dict:
    # Mixtral: a llama file with experts
    experts = moe_config(meta, cfg, experts_key="num_local_experts", size_key="intermediate_size", renormalize=True)
    return {**_sliding_everywhere(meta, cfg), **experts, **({"architectures": ["MixtralForCausalLM"]} if experts else {})}


def _qwen2vl(meta: Meta, cfg: dict) -> dict:
    # Qwen2.5-VL's decoder: its M-RoPE sections (llama.cpp writes four; the fourth is unused)
    return {"mrope_section": [int(x) for x in list(meta("rope.dimension_sections"))[:3]]}


def _qwen3moe(meta: Meta, cfg: dict) -> dict:
    return moe_config(meta, cfg, experts_key="num_experts", size_key="moe_intermediate_size", renormalize=True)


def _qwen2moe(meta: Meta, cfg: dict) -> dict:
    return moe_config(meta, cfg, experts_key="num_experts", size_key="moe_intermediate_size", renormalize=False,
                      shared=True)


def _olmoe(meta: Meta, cfg: dict) -> dict:
    return moe_config(meta, cfg, experts_key="num_experts", size_key="intermediate_size", renormalize=False)


@dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture."""

    hf_architecture: str
    block_names: dict[str, tuple[str, frozenset[str]]]
    # convert_hf_to_gguf permuted q/k rows (for llama.cpp's interleaved RoPE): undone on load
    permuted_qk: bool = False
    # convert_hf_to_gguf stored norms as (offset + w) (Gemma: 1 + w): subtracted, giving HF's values
    norm_offset: float = 0.0
    config: Callable[[Meta, dict], dict] = _no_extra
    # block stems every layer must have (a file missing one is refused naming the tensor)
    required: frozenset[str] = field(default=frozenset())


_LLAMA_REQUIRED = frozenset({"attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                             "ffn_up", "ffn_down"})
_GEMMA_REQUIRED = _LLAMA_REQUIRED | {"post_attention_norm", "post_ffw_norm"}
_MOE_REQUIRED = (_LLAMA_REQUIRED - {"ffn_gate", "ffn_up", "ffn_down"}) | MOE_STEMS

GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", {**_LLAMA_BLOCK, **MOE_BLOCK}, permuted_qk=True, config=_llama,
                              required=_LLAMA_REQUIRED),
    "mistral": GGUFArchitecture("MistralForCausalLM", _LLAMA_BLOCK, permuted_qk=True, config=_sliding_everywhere,
                                required=_LLAMA_REQUIRED),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", _LLAMA_BLOCK, required=_LLAMA_REQUIRED),
    "qwen2vl": GGUFArchitecture("Qwen2ForCausalLM", _LLAMA_BLOCK, config=_qwen2vl, required=_LLAMA_REQUIRED),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", {**_LLAMA_BLOCK, **_QK_NORM},
                              required=_LLAMA_REQUIRED | set(_QK_NORM)),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", _GEMMA_BLOCK, norm_offset=1.0, config=_gemma2,
                               required=_GEMMA_REQUIRED),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", {**_GEMMA_BLOCK, **_QK_NORM}, norm_offset=1.0, config=_gemma3,
                               required=_GEMMA_REQUIRED | set(_QK_NORM)),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", _PHI3_BLOCK, config=_phi3, required=frozenset(_PHI3_BLOCK)),
    # mixture of experts (gguf_moe.py): every layer sparse
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", {**_LLAMA_BLOCK, **_QK_NORM, **MOE_BLOCK}, config=_qwen3moe,
                                 required=_MOE_REQUIRED | set(_QK_NORM)),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", {**_LLAMA_BLOCK, **MOE_BLOCK, **SHARED_EXPERT_BLOCK},
                                 config=_qwen2moe, required=_MOE_REQUIRED | SHARED_EXPERT_STEMS),
    "olmoe": GGUFArchitecture("OlmoeForCausalLM", {**_LLAMA_BLOCK, **_QK_NORM, **MOE_BLOCK}, config=_olmoe,
                              required=_MOE_REQUIRED | set(_QK_NORM)),
}
