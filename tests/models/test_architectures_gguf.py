"""Every GGUF architecture record against transformers: each tiny HF model of test_architectures.py is
written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes it (its tensor names and metadata
keys, spelled out here independently of the loader's tables; q/k rows permuted for llama, Gemma norms
stored as 1 + w, Phi-3's fused tensors), loaded in the exact mode, and compared with the HF model."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.models.test_architectures import LONG, VOCAB, _close, _prompts, _reference, make_hf_model

# HF sub-module -> llama.cpp block tensor stem (convert_hf_to_gguf / gguf-py's tensor map)
_COMMON = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm"}
_NAMES = {
    "llama": {**_COMMON, "post_attention_layernorm": "ffn_norm"},
    "gemma": {**_COMMON, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {**_COMMON, "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"},
}
# test architecture -> (llama.cpp architecture, name table, HF config overrides that llama.cpp's loader assumes)
CASES = {
    "qwen3": ("qwen3", "llama", {}),
    "mistral_window": ("llama", "llama", {}),
    "phi3_partial": ("phi3", "phi3", {}),
    "phi3_window_longrope": ("phi3", "phi3", {}),
    "gemma2": ("gemma2", "gemma", {"query_pre_attn_scalar": 16}),
    # llama.cpp's Gemma 3: every sixth layer global, q.k scaled by head_dim ** -0.5
    "gemma3": ("gemma3", "gemma", {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32}),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, table: str, path) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ints = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim}
    if getattr(cfg, "sliding_window", None):
        ints["attention.sliding_window"] = cfg.sliding_window
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        ints["rope.dimension_count"] = int(head_dim * rope["partial_rotary_factor"])
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(rope["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf writes Phi-3's LongRoPE
        original = rope["original_max_position_embeddings"]
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        scale = cfg.max_position_embeddings / original
        w.add_float32(f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            w.add_float32(f"{arch}.{key}", float(getattr(cfg, key)))
    names = _NAMES[table]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{suffix}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                value = _permute(value, heads)
        if table == "gemma" and name.endswith("norm.weight"):
            value = value + 1.0  # convert_hf_to_gguf stores Gemma's norms as 1 + w
        w.add_tensor(gname, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(CASES))
def gguf_case(request, tmp_path_factory):
    arch, table, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param, folder / "hf", **overrides)
    path = folder / "model.gguf"
    write_gguf(model, arch, table, path)
    runner = ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=4096, max_running_requests=4,
                                    dtype="float32", quantization="none"))
    return model, runner


def test_gguf_equals_transformers(gguf_case):
    model, runner = gguf_case
    assert runner.model_config.vocab_size == VOCAB
    prompts = _prompts(5, (LONG + 3, 6))
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    pre = hb.split(hb.all_logprobs(hb.run([(r, p[:-2]) for r, p in zip(rows, prompts)])), [len(p) - 2 for p in prompts])
    dec = [hb.all_logprobs(hb.run([(r, [p[-2 + s]]) for r, p in zip(rows, prompts)])) for s in range(2)]
    hb.release_all()
    for i, p in enumerate(prompts):
        ref = _reference(model, p)
        _close(pre[i], ref[:-2])
        _close(torch.stack([d[i] for d in dec]), ref[-2:])


def test_a_missing_tensor_is_named(tmp_path) -> None:
    """A GGUF that lacks a tensor its architecture needs is refused naming it, before anything loads."""
    model = make_hf_model("qwen3", tmp_path / "hf")
    state = model.state_dict()
    del state["model.layers.1.self_attn.k_norm.weight"]
    model.state_dict = lambda: state  # the writer reads the state dict: write the file without it
    write_gguf(model, "qwen3", "llama", tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"blk\.1\.attn_k_norm\.weight"):
        ModelRunner(ServerArgs(model_path=str(tmp_path / "m.gguf"), max_total_tokens=256, quantization="none"))
