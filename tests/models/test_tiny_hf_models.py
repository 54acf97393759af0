"""Tiny random models saved in Hugging Face format: our Llama-family implementation against
transformers' own, for each architecture variant the loader supports."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

VARIANTS = {
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "llama3_rope_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama_linear_rope_untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
}


# (linear_backend, attention_backend): the CPU fast paths (oneDNN packed GEMMs, C++ paged attention)
# and plain PyTorch must both match transformers.
BACKENDS = {"fast": ("auto", "auto"), "plain": ("torch", "torch_native")}


@pytest.fixture(scope="module", params=[(v, b) for v in VARIANTS for b in BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request, tmp_path_factory):
    import transformers

    variant, backend = request.param
    cfg_name, model_name, extra = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra})
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(variant)
    model.save_pretrained(path, safe_serialization=True)
    linear, attention = BACKENDS[backend]
    # the exact mode on every CPU (dtype auto would be bf16 GEMMs where bf16 matmul is native)
    runner = ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=2048, max_running_requests=8,
                                    linear_backend=linear, attention_backend=attention, dtype="float32"))
    return model, runner


def test_prefill_and_decode_match_transformers(tiny):
    model, runner = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (7, 200)]
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    # a 200-token prompt reaches past original_max_position_embeddings (64): scaling matters
    res = hb.run([(r, p[:-1]) for r, p in zip(rows, prompts)])
    ours = hb.split(hb.all_logprobs(res), [len(p) - 1 for p in prompts])
    dec = hb.all_logprobs(hb.run([(r, p[-1:]) for r, p in zip(rows, prompts)]))
    hb.release_all()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)
        assert (ours[i] - ref[:-1]).abs().max().item() < 1e-4
        assert (dec[i] - ref[-1]).abs().max().item() < 1e-4


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(**BASE)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(cfg_path.read_text().replace('"LlamaForCausalLM"', '"FooForCausalLM"'))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        ModelRunner(ServerArgs(model_path=str(tmp_path), max_total_tokens=256))


def test_backends_are_the_ones_asked_for(tiny):
    from radixserve.kernels.cpu import load_paged_attention
    from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    _, runner = tiny
    args = runner.server_args
    packed = [m.packed is not None for m in runner.model.modules() if hasattr(m, "packed")]
    if args.linear_backend == "torch":
        assert not any(packed) and runner.linear_backend == "torch"
    else:  # auto on CPU float32 with oneDNN: every projection and the LM head packed
        assert all(packed) == (runner.linear_backend == "onednn")
    fast = args.attention_backend == "auto" and load_paged_attention()[0] is not None
    assert isinstance(runner.attn_backend, CpuPagedAttnBackend) == fast
    glue = [m.cpu_ops is not None for m in runner.model.modules() if hasattr(m, "cpu_ops")]
    assert glue and all(glue) == fast and any(glue) == fast  # norms, rope, activation follow the backend
