"""The model hyper-parameters the engine needs, normalised from a Hugging Face style config dict.

Both loaders (HF folders and GGUF files) end up here: the GGUF loader first translates its metadata
into an HF-style dict, so there is one place that knows about defaults and legacy key spellings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures whose attention q/k/v projections always carry a bias, whatever the config says
# (Qwen2's config has no `attention_bias` key; the modelling code hard-codes bias=True).
_QKV_BIAS_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})

# model_type -> architecture, for configs that lack an `architectures` list.
_ARCH_FROM_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_CONTEXT_LEN = 2048


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in the engine's own normalised form."""

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
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict, context_length: int | None = None) -> ModelConfig:
        """Build a ModelConfig from a parsed HF `config.json` dict.

        `context_length`, when given, overrides `max_position_embeddings`. Raises ValueError when a
        required field is missing or malformed.
        """
        architecture = _architecture(cfg)
        hidden_size = _required_int(cfg, "hidden_size")
        num_heads = _required_int(cfg, "num_attention_heads")
        num_kv_heads = _optional_int(cfg, "num_key_value_heads") or num_heads
        # Some configs carry `"head_dim": null`; treat it like an absent key.
        head_dim = _optional_int(cfg, "head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = normalise_rope(cfg)
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
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required_int(cfg, "intermediate_size"),
            num_hidden_layers=_required_int(cfg, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_required_int(cfg, "vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=context_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or architecture in _QKV_BIAS_ARCHITECTURES,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=_optional_int(cfg, "bos_token_id"),
            eos_token_ids=merge_token_ids(cfg.get("eos_token_id")),
        )


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
