"""Translate GGUF metadata into an HF-style config dict (then ModelConfig.from_hf_config does the rest), and the
ModelConfig of a GGUF file, cached on disk. No torch here: the HTTP process reads configs (docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from radixserve.model_loader import gguf_cache
from radixserve.model_loader.gguf_arch import GGUF_ARCHITECTURES, GGUFArchitecture
from radixserve.model_loader.gguf_file import GGUFFile, open_gguf
from radixserve.model_loader.gguf_moe import check_expert_tensors
from radixserve.model_loader.gguf_rope import gguf_rope_scaling
from radixserve.model_loader.model_config import ModelConfig

# Token ids llama.cpp treats as end-of-generation, besides plain EOS (end-of-turn, end-of-message).
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_record(f: GGUFFile) -> GGUFArchitecture:
    """The file's architecture record (gguf_arch.py)."""
    return GGUF_ARCHITECTURES[gguf_architecture(f)]


def gguf_architecture(f: GGUFFile) -> str:
    """The llama.cpp architecture name, validated against the ones we serve."""
    if not f.has("general.architecture"):
        raise ValueError(f"GGUF file {f.path} has no general.architecture metadata")
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ValueError(f"GGUF file {f.path} has unsupported architecture {arch!r} (supported: {supported})")
    return arch


def gguf_hf_config(f: GGUFFile) -> dict[str, Any]:
    """An HF `config.json`-style dict built from the file's metadata and tensor shapes."""
    arch = gguf_architecture(f)
    if int(f.get("split.count", 1)) > 1:
        raise ValueError(f"GGUF file {f.path} is one part of a split model; merge it with gguf-split first")

    def meta(key: str, default: Any = None) -> Any:
        value = f.get(f"{arch}.{key}", default)
        if isinstance(value, list) and key != "rope.dimension_sections":  # M-RoPE's sections are a list by design
            # Per-layer arrays (e.g. varying head counts) describe models we do not serve.
            # ValueError, not TypeError: the loader's contract is ValueError for any unusable model file.
            raise ValueError(f"GGUF file {f.path}: per-layer {arch}.{key} is not supported")
        return value

    def required(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise ValueError(f"GGUF file {f.path} is missing metadata {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    # key_length is written when head_dim != hidden/heads (Qwen3, Gemma); llama.cpp also records the
    # rotary width, which is the head size unless the record reads it as partial rotary (Phi-3)
    head_dim = int(
        meta("attention.key_length", None) or meta("rope.dimension_count", None) or hidden // heads
    )
    rope_theta = float(meta("rope.freq_base", 10000.0))
    record = GGUF_ARCHITECTURES[arch]
    cfg = {
        "architectures": [record.hf_architecture],
        "hidden_size": hidden,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": _vocab_size(f, arch),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": gguf_rope_scaling(f, rope_theta, head_dim),
        "max_position_embeddings": int(required("context_length")),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "hidden_act": "silu",
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": [f.get(key) for key in _EOS_KEYS if f.has(key)],
    }
    extra = record.config(meta, cfg)
    cfg = {**cfg, **{k: v for k, v in extra.items() if v is not None}}
    return check_expert_tensors(f, cfg)  # a MoE file's metadata against its 3-D expert tensors


def _vocab_size(f: GGUFFile, arch: str) -> int:
    # The embedding's row count is what the weights need; the token list can be shorter when a
    # converter padded the embedding, so it is only a fallback.
    if "token_embd.weight" in f.tensors:
        return f.hf_shape("token_embd.weight")[0]
    size = f.get(f"{arch}.vocab_size", None) or f.array_len("tokenizer.ggml.tokens")
    if not size:
        raise ValueError(f"GGUF file {f.path} has neither token_embd.weight nor a vocabulary size")
    return int(size)


def get_gguf_config(path: str, context_length: int | None = None) -> ModelConfig:
    """The ModelConfig of a GGUF model; `context_length` overrides its trained context length.

    The HF-style dict is cached on disk (not the ModelConfig) so the override is applied and
    validated by the same code whether or not the cache hit.
    """
    entry = gguf_cache.cache_entry(path)
    cfg = gguf_cache.load_config(entry) if entry else None
    if cfg is None:
        cfg = gguf_hf_config(open_gguf(path))
        ModelConfig.from_hf_config(cfg)  # validate before caching: a bad file must keep failing
        if entry:
            gguf_cache.save_config(entry, cfg)
    return ModelConfig.from_hf_config(cfg, context_length)
