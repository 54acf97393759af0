"""The model hyper-parameters the engine needs, normalised from a Hugging Face style config dict.

Both loaders (HF folders and GGUF files) end up here: the GGUF loader first translates its metadata
into an HF-style dict, so there is one place that knows about defaults and legacy key spellings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.model_loader.classifier_config import classifier_fields
from radixserve.model_loader.moe_config import MOE_SPECS, moe_fields
from radixserve.model_loader.vlm_config import VISION_ARCHITECTURES, mrope_section, text_config

# model_type -> architecture, for configs that lack an `architectures` list.
_ARCH_FROM_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",  # Qwen2.5-VL's decoder (its M-RoPE: ModelConfig.mrope_section)
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    # mixture of experts (moe_config.py)
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_CONTEXT_LEN = 2048

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types spelling


@dataclass(frozen=True)
class ArchSpec:
    """What one architecture's arithmetic is, beyond the Llama baseline: the config keys it implements
    (any other arithmetic key with a non-neutral value is refused, naming it) and its fixed traits."""

    qkv_bias: bool = False  # q/k/v always carry a bias whatever the config says (Qwen2 hard-codes it)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # four norms a block: around attention and around the MLP (Gemma 2/3)
    norm_offset: float = 0.0  # checkpoint norms store w, the layer multiplies by (offset + w) (Gemma: 1)
    embed_scale_by_sqrt_hidden: bool = False  # Gemma multiplies the embeddings by sqrt(hidden)
    qk_norm_full: bool = False  # the QK-norm spans the whole q / k projection, not each head (OLMoE)
    implements: frozenset[str] = frozenset()  # arithmetic keys of ARITHMETIC_KEYS this architecture honours


# Config keys that change the arithmetic, each with the test that says it is neutral (absent, None or a
# value that computes nothing different). A key an architecture does not implement must be neutral.
ARITHMETIC_KEYS: dict[str, Any] = {
    "sliding_window": lambda v: v is None,
    "attn_logit_softcapping": lambda v: v is None,
    "final_logit_softcapping": lambda v: v is None,
    "query_pre_attn_scalar": lambda v: v is None,
    "partial_rotary_factor": lambda v: v is None or float(v) == 1.0,
    "use_bidirectional_attention": lambda v: not v,
    "attn_temperature_tuning": lambda v: not v,
    "num_experts": lambda v: not v,
    "num_local_experts": lambda v: not v,
    "moe_intermediate_size": lambda v: not v,
    "mlp_bias": lambda v: not v,
    "residual_multiplier": lambda v: v is None or float(v) == 1.0,
    "embedding_multiplier": lambda v: v is None or float(v) == 1.0,
    "logits_scaling": lambda v: v is None or float(v) == 1.0,
    "attention_multiplier": lambda v: v is None,
    "rope_local_base_freq": lambda v: v is None,
    "layer_types": lambda v: v is None or all(t == FULL for t in v),
    "shared_expert_intermediate_size": lambda v: not v,
    "clip_qkv": lambda v: v is None,
    "qkv_bias": lambda v: v is None or bool(v),  # Qwen2-MoE's; True is what its attention always has
}

_MOE_KEYS = frozenset({"num_experts", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size"})

ARCH_SPECS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(implements=frozenset({"sliding_window"})),  # GGUF "llama" files of Mistral v0.1
    "MistralForCausalLM": ArchSpec(implements=frozenset({"sliding_window"})),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, implements=frozenset({"sliding_window", "layer_types"})),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True, implements=frozenset({"sliding_window", "layer_types"})),
    "Phi3ForCausalLM": ArchSpec(implements=frozenset({"sliding_window", "partial_rotary_factor"})),
    "Gemma2ForCausalLM": ArchSpec(
        sandwich_norms=True, norm_offset=1.0, embed_scale_by_sqrt_hidden=True,
        implements=frozenset({"sliding_window", "layer_types", "attn_logit_softcapping",
                              "final_logit_softcapping", "query_pre_attn_scalar"})),
    "Gemma3ForCausalLM": ArchSpec(
        qk_norm=True, sandwich_norms=True, norm_offset=1.0, embed_scale_by_sqrt_hidden=True,
        implements=frozenset({"sliding_window", "layer_types", "attn_logit_softcapping",
                              "final_logit_softcapping", "query_pre_attn_scalar", "rope_local_base_freq"})),
    # mixture of experts: the experts' keys are read by moe_config.moe_fields
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, implements=_MOE_KEYS | {"sliding_window", "layer_types"}),
    "Qwen2MoeForCausalLM": ArchSpec(qkv_bias=True, implements=_MOE_KEYS | {"sliding_window", "layer_types"}),
    "OlmoeForCausalLM": ArchSpec(qk_norm=True, qk_norm_full=True, implements=_MOE_KEYS),
    "MixtralForCausalLM": ArchSpec(implements=_MOE_KEYS | {"sliding_window"}),
}

# hidden activations the gated MLP implements, by the spellings configs use
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in the engine's own normalised form: everything the
    arithmetic depends on, per layer where layers differ (window, RoPE base)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str  # "silu" | "gelu_tanh": the gated MLP's activation
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # per layer: "full_attention" or "sliding_attention" (window `sliding_window`)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # the sliding layers' RoPE base where it differs (Gemma 3)
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (0: the whole head)
    mrope_section: tuple[int, ...] | None = None  # M-RoPE (Qwen2.5-VL): rotary pairs per (t, h, w) position
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # q.k multiplier (0: head_dim ** -0.5)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # max_position_embeddings as trained (YaRN / LongRoPE derive defaults from it, never from an override)
    trained_context_len: int = 0
    # mixture of experts (moe_config.py; layers/moe/): num_experts 0 is a dense model
    qk_norm_full: bool = False  # QK-norm over the whole q / k width (OLMoE), not per head
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    moe_layers: tuple[int, ...] = ()  # the sparse layers; the others run the dense MLP
    # a *ForSequenceClassification checkpoint: its `score` head's labels, in place of the LM head (0: a language
    # model); served with --is-embedding, the last token's logits over them (rerank and score)
    num_labels: int = 0
    # a vision-language model: the whole HF config (vision_config, projector, image token); the other fields
    # describe its text decoder. None: text only
    mm_config: dict | None = field(default=None, compare=False, repr=False)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id` (None: global attention)."""
        types = self.layer_types
        return self.sliding_window if types and types[layer_id] == SLIDING else None

    def layer_rope_theta(self, layer_id: int) -> float:
        if self.rope_local_theta is not None and self.layer_window(layer_id) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def scaling(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @classmethod
    def from_hf_config(cls, cfg: dict, context_length: int | None = None) -> ModelConfig:
        """Build a ModelConfig from a parsed HF `config.json` dict.

        `context_length`, when given, overrides `max_position_embeddings`. Raises ValueError when a required
        field is missing or malformed, or names an arithmetic key this architecture does not implement.
        """
        if _architecture(cfg) in VISION_ARCHITECTURES:  # the text decoder's ModelConfig, carrying the whole config
            # the outer config's stop tokens (from generation_config.json and the tokenizer) hold for the text
            text = {**text_config(cfg), "eos_token_id": list(merge_token_ids(cfg["text_config"].get("eos_token_id"),
                                                                             cfg.get("eos_token_id")))}
            return replace(cls.from_hf_config(text, context_length), architecture=_architecture(cfg), mm_config=cfg,
                           mrope_section=mrope_section(cfg))
        architecture, num_labels = classifier_fields(_architecture(cfg), cfg)
        spec = ARCH_SPECS.get(architecture)
        if spec is None:
            raise ValueError(f"unknown model architecture {architecture!r}; supported: {', '.join(sorted(ARCH_SPECS))}")
        for key, neutral in ARITHMETIC_KEYS.items():
            if key in cfg and key not in spec.implements and not neutral(cfg[key]):
                raise ValueError(f"model config key {key!r} = {cfg[key]!r} changes the arithmetic and is not "
                                 f"implemented for {architecture}")
        hidden_size = _required_int(cfg, "hidden_size")
        num_heads = _required_int(cfg, "num_attention_heads")
        num_kv_heads = _optional_int(cfg, "num_key_value_heads") or num_heads
        # Some configs carry `"head_dim": null`; treat it like an absent key.
        head_dim = _optional_int(cfg, "head_dim") or hidden_size // num_heads
        num_layers = _required_int(cfg, "num_hidden_layers")
        rope_theta, rope_scaling, local_theta, partial = _rope_by_layer_type(cfg)
        if context_length is None:
            context_len = _optional_int(cfg, "max_position_embeddings") or _DEFAULT_CONTEXT_LEN
        else:
            context_len = int(context_length)
        if context_len <= 0:
            raise ValueError(f"context length must be positive, got {context_len}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        act_name = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
        if act_name not in ACTIVATIONS:
            raise ValueError(f"model config hidden_act {act_name!r} is not implemented "
                             f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        window = _optional_int(cfg, "sliding_window")
        layer_types = _layer_types(cfg, architecture, num_layers, window)
        if partial != 1.0 and "partial_rotary_factor" not in spec.implements:
            raise ValueError(f"model config key 'partial_rotary_factor' = {partial} changes the arithmetic and "
                             f"is not implemented for {architecture}")
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {partial} gives an odd or empty rotary width of {rotary_dim}")
        pre_attn = cfg.get("query_pre_attn_scalar") if "query_pre_attn_scalar" in spec.implements else None
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required_int(cfg, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_required_int(cfg, "vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=context_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or spec.qkv_bias,
            hidden_act=ACTIVATIONS[act_name],
            bos_token_id=_optional_int(cfg, "bos_token_id"),
            eos_token_ids=merge_token_ids(cfg.get("eos_token_id")),
            layer_types=layer_types,
            sliding_window=window if SLIDING in layer_types else None,
            rope_local_theta=local_theta,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim, mrope_section=mrope_section(cfg),
            qk_norm=spec.qk_norm,
            sandwich_norms=spec.sandwich_norms,
            norm_offset=spec.norm_offset,
            embed_scale=float(hidden_size) ** 0.5 if spec.embed_scale_by_sqrt_hidden else 1.0,
            attn_scale=float(pre_attn) ** -0.5 if pre_attn else 0.0,
            attn_logit_softcap=_cap(cfg, "attn_logit_softcapping", spec),
            final_logit_softcap=_cap(cfg, "final_logit_softcapping", spec),
            trained_context_len=_optional_int(cfg, "max_position_embeddings") or _DEFAULT_CONTEXT_LEN,
            qk_norm_full=spec.qk_norm_full,
            num_labels=num_labels,
            **_moe(cfg, architecture, num_layers),
        )


def _moe(cfg: dict, architecture: str, num_layers: int) -> dict[str, Any]:
    spec = MOE_SPECS.get(architecture)
    return {} if spec is None else vars(moe_fields(cfg, spec, num_layers))


def _cap(cfg: dict, key: str, spec: ArchSpec) -> float | None:
    value = cfg.get(key) if key in spec.implements else None
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"model config {key} must be > 0 or null, got {value!r}")
    return float(value)


def _layer_types(cfg: dict, architecture: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    """Which layers attend through the sliding window. transformers 5 writes `layer_types`; older configs
    say it with `use_sliding_window` + `max_window_layers` (Qwen2: layers >= max_window_layers slide) or,
    for Mistral / Phi-3, a plain `sliding_window` (every layer)."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"model config layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}")
        types = tuple(types)
        if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
            types = (FULL,) * num_layers  # Qwen2/3 write sliding types but switch them off here
    elif "use_sliding_window" in cfg:
        first = int(cfg.get("max_window_layers") or 0)
        types = tuple(SLIDING if cfg["use_sliding_window"] and i >= first else FULL for i in range(num_layers))
    elif architecture.startswith("Gemma2"):
        types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    else:
        types = (SLIDING if window is not None else FULL,) * num_layers
    if SLIDING in types and (window is None or window < 1):
        raise ValueError(f"model config has sliding-window layers but sliding_window = {window!r}")
    return types


def _rope_by_layer_type(cfg: dict) -> tuple[float, dict | None, float | None, float]:
    """(global theta, global scaling, the sliding layers' theta or None, partial rotary factor).

    transformers 5 may key `rope_parameters` by layer type (Gemma 3: {"sliding_attention": {...},
    "full_attention": {...}}); older Gemma 3 configs write `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    local_theta = cfg.get("rope_local_base_freq")
    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING)
        if isinstance(local, dict):
            local_theta, local_scaling, _ = _rope_one({"rope_parameters": local})
            if local_scaling is not None:
                raise ValueError(f"rope scaling of the sliding layers is not implemented: {local_scaling}")
        cfg = {**cfg, "rope_parameters": params[FULL]}
    theta, scaling, partial = _rope_one(cfg)
    return theta, scaling, None if local_theta is None else float(local_theta), partial


def _rope_one(cfg: dict) -> tuple[float, dict | None, float]:
    params = cfg.get("rope_parameters")
    partial = cfg.get("partial_rotary_factor")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        partial = params["partial_rotary_factor"]
        params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
        cfg = {**cfg, "rope_parameters": params}
    theta, scaling = normalise_rope(cfg)
    return theta, scaling, 1.0 if partial is None else float(partial)


def normalise_rope(cfg: dict) -> tuple[float, dict | None]:
    """Return `(rope_theta, rope_scaling)` from either the legacy or the transformers-5 spelling.

    transformers < 5 writes `rope_theta` plus an optional `rope_scaling` dict (keyed by `type` in
    older files, `rope_type` in newer ones); transformers 5 folds both into `rope_parameters`.
    Plain RoPE ("default") becomes `None` so callers only test for presence.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    merged: dict[str, Any] = {}
    for source in (params, scaling):
        if isinstance(source, dict):
            merged.update(source)
    if theta is None:
        theta = merged.get("rope_theta", _DEFAULT_ROPE_THETA)
    merged.pop("rope_theta", None)
    if "type" in merged:
        merged.setdefault("rope_type", merged["type"])
        del merged["type"]
    rope_type = merged.get("rope_type")
    if rope_type in (None, "default") and not _has_scaling_fields(merged):
        return float(theta), None
    if rope_type is None:
        raise ValueError(f"rope scaling parameters without a rope type: {merged}")
    return float(theta), merged


def merge_token_ids(*sources: Any) -> tuple[int, ...]:
    """Flatten int / list / None token id sources into one ordered, de-duplicated tuple."""
    ids: list[int] = []
    for source in sources:
        if source is None:
            continue
        values = source if isinstance(source, (list, tuple)) else [source]
        for value in values:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def _has_scaling_fields(rope: dict) -> bool:
    # A "default" entry that still carries a factor would silently lose it; surface it instead.
    return any(key in rope for key in ("factor", "original_max_position_embeddings"))


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if isinstance(archs, (list, tuple)) and archs:
        return str(archs[0])
    model_type = cfg.get("model_type")
    if model_type in _ARCH_FROM_MODEL_TYPE:
        return _ARCH_FROM_MODEL_TYPE[model_type]
    raise ValueError(f"config names no architecture (architectures={archs!r}, model_type={model_type!r})")


def _required_int(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ValueError(f"model config is missing required field {key!r}")
    return _as_int(key, value)


def _optional_int(cfg: dict, key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        # e.g. a list-valued bos_token_id: the first one is what a tokenizer would prepend.
        return _as_int(key, value[0]) if value else None
    return _as_int(key, value)


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"model config field {key!r} must be an integer, got {value!r}")
    return int(value)
