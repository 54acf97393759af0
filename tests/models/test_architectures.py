"""Every registered architecture, as a tiny random transformers model saved as an HF folder, against
transformers itself in float32 (eager attention), through every forward mode: PREFILL, chunked EXTEND
(chunks that straddle the window edge), DECODE, MIXED and TARGET_VERIFY, alone and batched, on the fast
CPU backends and on plain PyTorch.

Window architectures get a window of a few tokens and prompts longer than three windows, so every path
reads keys across the window edge; soft-caps are small so that they bend real scores."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
W = 5  # the sliding window of the window architectures
LONG = 3 * W + 9

# name -> (config class, model class, config fields)
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=W,
                                                             max_window_layers=1)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=W, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=W, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, pad_token_id=0)),
    # LongRoPE: served past the original context, every position takes the long factors (llama.cpp's static
    # rule); transformers takes them for a forward whose length exceeds the original, as every one here does
    "phi3_window_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=W, pad_token_id=0, original_max_position_embeddings=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.5 * i for i in range(8)],
                         "original_max_position_embeddings": 4})),
}

BACKENDS = {"fast": ("auto", "auto"), "plain": ("torch", "torch_native")}


def make_hf_model(arch: str, path, **overrides) -> torch.nn.Module:
    """The tiny transformers model of `arch`, saved to `path` (biases and norms randomised so they matter)."""
    import transformers

    cfg_name, model_name, extra = ARCHITECTURES[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(0.0 if "gemma" in arch else 1.0, 0.3)  # Gemma norms are (1 + w)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=[(a, b) for a in ARCHITECTURES for b in BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def arch_runner(request, tmp_path_factory):
    arch, backend = request.param
    path = tmp_path_factory.mktemp(arch)
    model = make_hf_model(arch, path)
    linear, attention = BACKENDS[backend]
    runner = ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=4096, max_running_requests=8,
                                    linear_backend=linear, attention_backend=attention, dtype="float32",
                                    quantization="none"))
    return arch, model, runner


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _prompts(n: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lens]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4, f"max |logprob difference| {err:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_prefill_then_decode_batched(arch_runner):
    """Two prompts (one short, one over three windows) prefilled together, then 4 DECODE steps together."""
    _, model, runner = arch_runner
    prompts = _prompts(1, (7, LONG + 4))
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    ctx = 4
    res = hb.run([(r, p[:-ctx]) for r, p in zip(rows, prompts)])
    pre = hb.split(hb.all_logprobs(res), [len(p) - ctx for p in prompts])
    decoded = [[] for _ in prompts]
    for step in range(ctx):
        out = hb.all_logprobs(hb.run([(r, [p[-ctx + step]]) for r, p in zip(rows, prompts)]))
        for i in range(len(prompts)):
            decoded[i].append(out[i])
    hb.release_all()
    for i, p in enumerate(prompts):
        ref = _reference(model, p)
        _close(pre[i], ref[: len(p) - ctx])
        _close(torch.stack(decoded[i]), ref[len(p) - ctx:])


@pytest.mark.parametrize("chunk", [3, W + 2])
def test_chunked_extend_across_the_window(arch_runner, chunk):
    """A long prompt as EXTEND chunks over its own cached prefix (what a radix hit or chunked prefill runs)."""
    _, model, runner = arch_runner
    (prompt,) = _prompts(2, (LONG,))
    hb = HandBatch(runner)
    row = hb.new_req()
    outs = []
    for s in range(0, len(prompt), chunk):
        outs.append(hb.all_logprobs(hb.run([(row, prompt[s : s + chunk])])))
    hb.release_all()
    _close(torch.cat(outs), _reference(model, prompt))


def test_mixed_and_verify(arch_runner):
    """One MIXED step (an EXTEND chunk past the window, a DECODE token, a fresh prompt), then one
    TARGET_VERIFY step with different draft counts per request."""
    _, model, runner = arch_runner
    a, b, c = _prompts(3, (LONG, LONG + 2, 9))
    hb = HandBatch(runner)
    ra, rb, rc = (hb.new_req() for _ in range(3))
    hb.run([(ra, a[:8]), (rb, b[:-1])])
    mixed = hb.all_logprobs(hb.run([(ra, a[8:LONG - 3]), (rb, b[-1:]), (rc, c[:6])], mode=ForwardMode.MIXED))
    m_a, m_b, m_c = hb.split(mixed, [LONG - 3 - 8, 1, 6])
    verify = hb.all_logprobs(hb.run([(ra, a[LONG - 3:]), (rc, c[6:7])], mode=ForwardMode.TARGET_VERIFY))
    v_a, v_c = hb.split(verify, [3, 1])
    hb.release_all()
    ref_a, ref_b, ref_c = _reference(model, a), _reference(model, b), _reference(model, c)
    _close(m_a, ref_a[8 : LONG - 3])
    _close(m_b, ref_b[-1:])
    _close(m_c, ref_c[:6])
    _close(v_a, ref_a[LONG - 3 :])
    _close(v_c, ref_c[6:7])


def test_greedy_generation_matches_transformers(arch_runner):
    """Greedy tokens, fed back one DECODE at a time, equal transformers' generate()."""
    _, model, runner = arch_runner
    (prompt,) = _prompts(4, (LONG,))
    new = 12
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             min_new_tokens=new, pad_token_id=0)[0, len(prompt):].tolist()
    hb = HandBatch(runner)
    row = hb.new_req()
    tokens = []
    step = prompt
    for _ in range(new):
        logprobs = hb.all_logprobs(hb.run([(row, step)]))
        tokens.append(int(logprobs[-1].argmax()))
        step = tokens[-1:]
    hb.release_all()
    assert tokens == ref


def test_decode_stack_or_one_log_line(arch_runner):
    """The native decode stack runs a model only when every layer declares what it implements."""
    from radixserve.models.base import DECODE_STACK_LAYERS

    _, _, runner = arch_runner
    declared = {runner.model.layer_arithmetic(i) for i in range(runner.model_config.num_hidden_layers)}
    if not all(a in DECODE_STACK_LAYERS for a in declared):
        assert runner.cpu_graph_runner is None
