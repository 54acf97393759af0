"""The mixture-of-experts GGUF records against transformers: each tiny HF MoE model is written as a GGUF the
way llama.cpp's convert_hf_to_gguf.py writes it (its tensor names and metadata keys, spelled out here
independently of the loader's tables: 3-D ffn_{gate,up,down}_exps, ffn_gate_inp, Qwen2-MoE's *_shexp
tensors with a vector shared-expert gate, Mixtral as `llama` with permuted q/k and llama.expert_count),
loaded in the exact mode and compared with the HF model; then the bad files: a missing expert tensor, a
lying expert_count or expert_used_count, a file cut inside an expert tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.models.moe_models import make_moe_model
from tests.models.test_architectures import LONG, VOCAB, _close, _prompts, _reference
from tests.models.test_architectures_gguf import _permute

# HF sub-module -> llama.cpp block tensor stem
_STEMS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# test architecture -> llama.cpp architecture
CASES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}


def _tensors(model, arch: str):
    """(llama.cpp name, float32 array) of every tensor, in convert_hf_to_gguf's layout."""
    cfg = model.config
    for name, tensor in model.state_dict().items():
        value = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", value
        elif name == "model.norm.weight":
            yield "output_norm.weight", value
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                yield "output.weight", value
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                gate, up = np.split(value, 2, axis=1)
                yield f"blk.{layer}.ffn_gate_exps.weight", gate
                yield f"blk.{layer}.ffn_up_exps.weight", up
                continue
            if rest == "mlp.experts.down_proj":
                yield f"blk.{layer}.ffn_down_exps.weight", value
                continue
            module, suffix = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                value = _permute(value, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
            if module == "mlp.shared_expert_gate":
                value = value.reshape(-1)  # llama.cpp's {n_embd}
            yield f"blk.{layer}.{_STEMS[module]}.{suffix}", value


def write_moe_gguf(model, arch: str, path, meta: dict | None = None, drop: str | None = None,
                   quant: dict[str, str] | None = None) -> None:
    """The GGUF of `model`; `meta` overrides metadata values (a lying file), `drop` leaves a tensor out,
    `quant` stores the tensors whose stem it names (`ffn_gate_exps`) in that GGML type (gguf.quants)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    ints = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "expert_count": experts, "expert_used_count": cfg.num_experts_per_tok}
    if getattr(cfg, "moe_intermediate_size", None):
        ints["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if getattr(cfg, "shared_expert_intermediate_size", None):
        ints["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    ints.update(meta or {})
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    for name, value in _tensors(model, arch):
        qtype = (quant or {}).get(name.split(".")[-2]) if name.startswith("blk.") else None
        if qtype is not None:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value), t), raw_dtype=t)
        elif name != drop:
            w.add_tensor(name, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _runner(path) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=2048, max_running_requests=4,
                                  dtype="float32", quantization="none"))


@pytest.fixture(scope="module", params=list(CASES))
def gguf_case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_moe_model(request.param, folder / "hf")
    write_moe_gguf(model, CASES[request.param], folder / "model.gguf")
    return request.param, model, _runner(folder / "model.gguf")


def test_gguf_equals_transformers(gguf_case) -> None:
    arch, model, runner = gguf_case
    cfg = runner.model_config
    assert cfg.vocab_size == VOCAB and cfg.architecture == model.config.architectures[0]
    assert cfg.moe_layers == (0, 1, 2) and cfg.num_experts == 8
    assert cfg.norm_topk_prob == (arch in ("qwen3_moe", "mixtral"))  # llama.cpp's per-architecture rule
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


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory):
    return make_moe_model("qwen3_moe", tmp_path_factory.mktemp("bad") / "hf")


@pytest.mark.parametrize("meta, drop, message", [
    ({}, "blk.1.ffn_up_exps.weight", r"lacks tensor 'blk\.1\.ffn_up_exps\.weight'"),
    ({}, "blk.2.ffn_gate_inp.weight", r"lacks tensor 'blk\.2\.ffn_gate_inp\.weight'"),
    ({"expert_count": 6}, None, r"blk\.0\.ffn_gate_inp\.weight has shape \[8, 64\].*expert_count = 6"),
    ({"expert_count": 10**6}, None, r"expert_count = 1000000"),
    ({"expert_feed_forward_length": 48}, None, r"ffn_gate_exps\.weight has shape \[8, 32, 64\].*expert size 48"),
    ({"expert_used_count": 9}, None, r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"),
    ({"expert_used_count": 0}, None, r"num_experts_per_tok \(0\)"),
], ids=["missing-expert-tensor", "missing-router", "lying-expert-count", "absurd-expert-count",
        "lying-expert-size", "top-k-over-experts", "top-k-zero"])
def test_a_bad_moe_gguf_is_named(qwen3_hf, tmp_path, meta, drop, message) -> None:
    path = tmp_path / "bad.gguf"
    write_moe_gguf(qwen3_hf, "qwen3moe", path, meta=meta, drop=drop)
    with pytest.raises(ValueError, match=message):
        _runner(path)
    good = tmp_path / "good.gguf"  # and a good file still loads after it
    write_moe_gguf(qwen3_hf, "qwen3moe", good)
    assert _runner(good).model_config.num_experts == 8


def test_a_file_cut_inside_an_expert_tensor(qwen3_hf, tmp_path) -> None:
    path = tmp_path / "cut.gguf"
    write_moe_gguf(qwen3_hf, "qwen3moe", path)
    cut = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.2.ffn_down_exps.weight")
    path.write_bytes(path.read_bytes()[: int(cut.data_offset) + 100])
    with pytest.raises(ValueError, match="truncated"):
        _runner(path)
