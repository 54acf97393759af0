"""The mixture-of-experts part of llama.cpp's GGUF layout: expert tensor names, metadata keys, and the
checks that the metadata and the 3-D expert tensors agree.

    blk.{i}.ffn_gate_inp.weight      [experts, hidden]          the router
    blk.{i}.ffn_{gate,up}_exps.weight [experts, inter, hidden]   every expert's gate / up, stacked
    blk.{i}.ffn_down_exps.weight     [experts, hidden, inter]
    blk.{i}.ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp         Qwen2-MoE's shared expert and its gate
    {arch}.expert_count, {arch}.expert_used_count, {arch}.expert_feed_forward_length,
    {arch}.expert_shared_feed_forward_length, {arch}.expert_weights_norm (absent: llama.cpp's per-architecture
    default, which is what build_moe_ffn hard-codes: qwen3moe and llama (Mixtral) renormalise, qwen2moe
    and olmoe do not)

Mixtral's GGUFs say `general.architecture = llama` and add the expert tensors and `llama.expert_count`.
Every layer of a MoE GGUF is sparse (llama.cpp requires ffn_gate_inp on each)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.model_loader.gguf_file import GGUFFile

Meta = Callable[[str, Any], Any]
_W = frozenset({"weight"})

MOE_BLOCK: dict[str, tuple[str, frozenset[str]]] = {
    "ffn_gate_inp": ("mlp.gate", _W),
    "ffn_gate_exps": ("mlp.experts.gate_proj", _W),
    "ffn_up_exps": ("mlp.experts.up_proj", _W),
    "ffn_down_exps": ("mlp.experts.down_proj", _W),
}
SHARED_EXPERT_BLOCK: dict[str, tuple[str, frozenset[str]]] = {
    "ffn_gate_inp_shexp": ("mlp.shared_expert_gate", _W),
    "ffn_gate_shexp": ("mlp.shared_expert.gate_proj", _W),
    "ffn_up_shexp": ("mlp.shared_expert.up_proj", _W),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", _W),
}
MOE_STEMS = frozenset(MOE_BLOCK)
SHARED_EXPERT_STEMS = frozenset(SHARED_EXPERT_BLOCK)
DENSE_FFN_STEMS = frozenset({"ffn_gate", "ffn_up", "ffn_down"})
_EXPERT_KEYS = ("num_experts", "num_local_experts")
_OWN_SIZE_KEY = frozenset({"qwen3moe", "qwen2moe"})  # their experts' size is not feed_forward_length


def moe_config(meta: Meta, cfg: dict, *, experts_key: str, size_key: str, renormalize: bool,
               shared: bool = False) -> dict:
    """The HF config keys of a GGUF's experts ({} for a file without `{arch}.expert_count`)."""
    count = meta("expert_count", None)
    if count is None:
        return {}
    used = meta("expert_used_count", None)
    if used is None:
        raise ValueError("GGUF file has expert_count but no expert_used_count metadata")
    out = {experts_key: int(count), "num_experts_per_tok": int(used),
           "norm_topk_prob": bool(meta("expert_weights_norm", renormalize))}
    size = meta("expert_feed_forward_length", None)
    if size is not None:
        out[size_key] = int(size)
    if shared:
        out["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", None)
    return out


def is_moe(cfg: dict) -> bool:
    return any(cfg.get(k) for k in _EXPERT_KEYS)


def required_stems(stems: frozenset[str], cfg: dict) -> frozenset[str]:
    """The block tensors every layer needs: a MoE file's experts replace the dense MLP's."""
    return (stems - DENSE_FFN_STEMS) | MOE_STEMS if is_moe(cfg) else stems


def check_expert_tensors(f: GGUFFile, cfg: dict) -> dict:
    """`cfg` with the routed experts' size read from the tensors where the metadata omits it, after checking
    that the metadata's expert count and sizes are what the expert tensors hold (a lying expert_count would
    otherwise read other experts' bytes or leave experts unfilled). Tensors absent here are named later."""
    if not is_moe(cfg):
        return cfg
    experts = int(next(cfg[k] for k in _EXPERT_KEYS if cfg.get(k)))
    hidden = int(cfg["hidden_size"])
    size_key = "moe_intermediate_size" if "moe_intermediate_size" in cfg or f.architecture in _OWN_SIZE_KEY \
        else "intermediate_size"
    if cfg.get(size_key) is None and "blk.0.ffn_gate_exps.weight" in f.tensors:
        cfg = {**cfg, size_key: f.hf_shape("blk.0.ffn_gate_exps.weight")[1]}
    inter = int(cfg[size_key])
    arch = f.architecture
    for i in range(int(cfg["num_hidden_layers"])):
        want = {"ffn_gate_inp": (experts, hidden), "ffn_gate_exps": (experts, inter, hidden),
                "ffn_up_exps": (experts, inter, hidden), "ffn_down_exps": (experts, hidden, inter)}
        for stem, shape in want.items():
            name = f"blk.{i}.{stem}.weight"
            if name in f.tensors and f.hf_shape(name) != shape:
                raise ValueError(
                    f"GGUF file {f.path}: tensor {name} has shape {list(f.hf_shape(name))}, but the metadata "
                    f"({arch}.expert_count = {experts}, expert size {inter}, hidden {hidden}) needs {list(shape)}")
    return cfg
