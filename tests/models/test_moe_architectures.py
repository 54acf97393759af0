"""Every mixture-of-experts architecture (Qwen3-MoE, Qwen3-MoE with a dense layer, Qwen2-MoE with its shared
expert, OLMoE, Mixtral) as a tiny random transformers model saved as an HF folder, against transformers in
float32 through every forward mode: PREFILL, chunked EXTEND, DECODE, MIXED and TARGET_VERIFY, alone and
batched, on the fast CPU backends and plain PyTorch (the forward-mode tests of test_architectures.py, run
on these models); plus routing skew: a batch whose every token picks one expert while another gets none,
with our per-step expert load equal to transformers' own routing."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.models.moe_models import DEAD, HOT, MOE_ARCHITECTURES, hf_expert_counts, make_moe_model
from tests.models.test_architectures import (  # noqa: F401  (the forward-mode tests, run on the MoE models)
    BACKENDS,
    LONG,
    _close,
    _prompts,
    _reference,
    test_chunked_extend_across_the_window,
    test_decode_stack_or_one_log_line,
    test_greedy_generation_matches_transformers,
    test_mixed_and_verify,
    test_prefill_then_decode_batched,
)


def _runner(path, backend: str = "fast") -> ModelRunner:
    linear, attention = BACKENDS[backend]
    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=4096, max_running_requests=8,
                                  linear_backend=linear, attention_backend=attention, dtype="float32",
                                  quantization="none"))


@pytest.fixture(scope="module", params=[(a, b) for a in MOE_ARCHITECTURES for b in BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def arch_runner(request, tmp_path_factory):
    arch, backend = request.param
    path = tmp_path_factory.mktemp(arch)
    model = make_moe_model(arch, path)
    return arch, model, _runner(path, backend)


def test_every_layer_declares_its_mlp(arch_runner) -> None:
    arch, _, runner = arch_runner
    cfg = runner.model_config
    kinds = [runner.model.layer_arithmetic(i).mlp for i in range(cfg.num_hidden_layers)]
    want = {"qwen3_moe_dense_layer": ["moe", "dense", "moe"], "qwen2_moe": ["moe_shared"] * 3}
    assert kinds == want.get(arch, ["moe"] * 3)
    assert runner.cpu_graph_runner is None


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def skewed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}_skewed")
    model = make_moe_model(request.param, path, skewed=True)
    return model, _runner(path)


def test_one_hot_expert_and_one_dead_expert(skewed) -> None:
    """Every token of a batched step routes to HOT and none to DEAD (transformers' routing says so); the
    results still equal transformers', and the step's expert load equals transformers' token counts."""
    model, runner = skewed
    prompts = _prompts(11, (LONG, 9, 5))
    refs = [hf_expert_counts(model, p) for p in prompts]
    expected = {layer: [sum(r[layer][e] for r in refs) for e in range(len(refs[0][layer]))] for layer in refs[0]}
    for counts in expected.values():
        assert counts[HOT] == sum(map(len, prompts)) and counts[DEAD] == 0, counts
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    runner.model.expert_load.take()
    out = hb.split(hb.all_logprobs(hb.run(list(zip(rows, prompts)))), [len(p) for p in prompts])
    load = runner.model.expert_load.take()
    hb.release_all()
    assert load == expected
    for got, p in zip(out, prompts):
        _close(got, _reference(model, p))


def test_expert_load_counts_every_pair_of_a_step(arch_runner) -> None:
    """Each sparse layer's load over one step sums to tokens x top-k and equals transformers' routing."""
    _, model, runner = arch_runner
    (prompt,) = _prompts(12, (13,))
    hb = HandBatch(runner)
    row = hb.new_req()
    runner.model.expert_load.take()
    hb.run([(row, prompt)])
    load = runner.model.expert_load.take()
    hb.release_all()
    assert load == hf_expert_counts(model, prompt)
    k = runner.model_config.num_experts_per_tok
    assert all(sum(c) == len(prompt) * k for c in load.values())


def test_fused_experts_equals_the_per_token_reference() -> None:
    """The token-grouped experts equal the plain per-token, per-slot loop, whatever the routing."""
    from radixserve.layers.activation import SiluAndMul
    from radixserve.layers.moe import TopKRouting, fused_experts

    g = torch.Generator().manual_seed(3)
    for tokens, experts, k in [(1, 4, 1), (7, 8, 2), (33, 16, 4), (5, 3, 3)]:
        x = torch.randn(tokens, 24, generator=g)
        w13 = torch.randn(experts, 2 * 10, 24, generator=g)
        w2 = torch.randn(experts, 24, 10, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g)
        out, counts = fused_experts(x, w13, w2, TopKRouting(weights, ids), SiluAndMul(), experts)
        ref = torch.zeros_like(x)
        for t in range(tokens):
            for s in range(k):
                e = int(ids[t, s])
                gate, up = (w13[e] @ x[t]).chunk(2)
                ref[t] += weights[t, s] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
        assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()


def test_a_missing_expert_tensor_is_named(tmp_path) -> None:
    """An HF folder whose checkpoint lacks one expert's projection is refused naming that tensor."""
    from safetensors.torch import load_file, save_file

    make_moe_model("mixtral", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    if name not in state:  # transformers' original format, either spelling of the MoE block
        name = name.replace("block_sparse_moe", "mlp")
    del state[name]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.\w+\.experts\.5\.w3\.weight"):
        _runner(tmp_path)
