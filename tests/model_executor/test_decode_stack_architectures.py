"""The native decode stack (CpuGraphRunner) on every registered architecture: for each one it implements
(Llama, Qwen2/3, Mistral, Gemma 2/3 layers: QK-norm, sandwich norms, GELU-tanh, sliding windows, attention
soft-caps, two RoPE bases), DECODE and TARGET_VERIFY steps through the stack equal bit for bit the same
model's layer-by-layer path with the same low-bit weights; an architecture it does not implement is refused,
naming the declared field that is outside it.

The models are tests/models/test_architectures.py's tiny transformers models (window W = 5 tokens, small
soft-caps that bend real scores), quantised to int8 at load so the stack can bind their weights; prompts are
longer than three windows, so every step reads keys across the window edge."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.base import DECODE_STACK_LAYERS
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.models.moe_models import MOE_ARCHITECTURES, make_moe_model
from tests.models.test_architectures import ARCHITECTURES, VOCAB, W, make_hf_model

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")

# architecture -> the LayerArithmetic field the stack does not implement
REFUSED = {"phi3_partial": "partial_rotary=True", "moe_olmoe": "qk_norm_full=True", "moe_qwen2_moe": "mlp='moe_shared'"}
PROMPT_LENS = (3 * W + 12, 3 * W + 5, 3 * W + 1)  # every prompt past three windows, all of different lengths
DRAFTS = 2  # TARGET_VERIFY: each request's last token + 2 drafts


# name -> (architecture, config overrides): one KV head (Gemma 3 270M / 1B) makes each step's k a strided
# view of the qkv output, not a copy, on its way to the per-head norm
VARIANTS = {arch: (arch, {}) for arch in ARCHITECTURES}
VARIANTS.update({f"{arch}_one_kv_head": (arch, {"num_key_value_heads": 1}) for arch in ("qwen3", "gemma3")})
# mixture of experts (tests/models/moe_models.py): routed experts through fused_experts inside the stack
VARIANTS.update({f"moe_{arch}": (arch, {}) for arch in MOE_ARCHITECTURES})
VARIANTS["moe_qwen2_moe"] = ("qwen2_moe", {"shared_expert_intermediate_size": 64})  # int8 takes 32-wide blocks


@pytest.fixture(scope="module", params=list(VARIANTS))
def stacked(request, tmp_path_factory) -> tuple[str, ModelRunner]:
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    (make_moe_model if request.param.startswith("moe_") else make_hf_model)(arch, path, **overrides)
    args = ServerArgs(model_path=str(path), quantization="int8", dtype="float32", max_total_tokens=2048,
                      max_running_requests=8)
    return request.param, ModelRunner(args)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill each prompt alone, then DECODE at batch 1, batch 1 again, all rows, and one TARGET_VERIFY
    step of all rows: the logits of the 4 steps the stack replays."""
    hb = HandBatch(runner)
    prompts = _prompts()
    rows = [hb.new_req() for _ in prompts]
    for row, prompt in zip(rows, prompts):
        hb.run([(row, prompt)], full=False)
    got = []
    for step in range(3):
        batch = rows[:1] if step < 2 else rows
        res = hb.run([(row, [11 + step + j]) for j, row in enumerate(batch)], full=False)
        got.append(res.logits_output.next_token_logits.clone())
    verify = [(row, [40 + j + d for d in range(DRAFTS + 1)]) for j, row in enumerate(rows)]
    res = hb.run(verify, mode=ForwardMode.TARGET_VERIFY, full=False)
    got.append(res.logits_output.next_token_logits.clone())
    hb.release_all()
    return got


def test_the_stack_takes_every_architecture_but_partial_rotary(stacked) -> None:
    """The decision follows the declared LayerArithmetic only, and a refusal names what is outside."""
    arch, runner = stacked
    model = runner.model
    declared = [model.layer_arithmetic(i) for i in range(runner.model_config.num_hidden_layers)]
    why = CpuGraphRunner._unsupported(runner)
    if arch in REFUSED:
        assert runner.cpu_graph_runner is None
        assert any(a not in DECODE_STACK_LAYERS for a in declared)
        assert why is not None and "does not implement" in why and REFUSED[arch] in why, why
    else:
        assert all(a in DECODE_STACK_LAYERS for a in declared)
        assert why is None and runner.cpu_graph_runner is not None, why


def test_stack_equals_the_layer_by_layer_path(stacked) -> None:
    arch, runner = stacked
    if arch in REFUSED:
        pytest.skip(f"the stack does not implement {arch}'s layers")
    layered = ModelRunner(runner.server_args.replace(disable_cpu_graph=True), model=runner.model)
    assert layered.cpu_graph_runner is None
    load = getattr(runner.model, "expert_load", None)  # MoE: the step's tokens per expert, both paths
    if load is not None:
        load.take()
    before = runner.cpu_graph_runner.replays
    stack_logits = _logits(runner)
    assert runner.cpu_graph_runner.replays == before + len(stack_logits)  # every step went through the stack
    stack_load = load.take() if load is not None else None
    layer_logits = _logits(layered)
    for step, (a, b) in enumerate(zip(stack_logits, layer_logits)):
        assert a.shape == b.shape
        assert torch.equal(a, b), f"{arch} step {step}: max |difference| {(a - b).abs().max().item():.3e}"
    if load is not None:
        assert stack_load == load.take() and stack_load


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(stacked) -> None:
    """The stack checks a step's KV slots once against the fewest any layer has (not layer by layer)."""
    arch, runner = stacked
    if runner.cpu_graph_runner is None or runner.token_to_kv_pool.hybrid:
        pytest.skip("no stack, or a hybrid pool (its slots are checked through the same minima)")
    stack, pool = runner.cpu_graph_runner.stack, runner.token_to_kv_pool
    slots = pool.get_kv_buffer(0)[0].shape[0]
    hidden = runner.model_config.hidden_size
    empty = torch.empty(0, dtype=torch.int64)
    before = [t.clone() for t in pool.get_kv_buffer(0)]
    for bad in (slots, -1):
        with pytest.raises(RuntimeError, match=f"out_loc {bad} outside the pool of {slots}"):
            stack.forward(torch.zeros(1, hidden), torch.zeros(1, dtype=torch.int64), torch.tensor([bad]),
                          torch.ones(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.get_kv_buffer(0)))


def test_gemma3_binds_both_rope_bases(stacked) -> None:
    """Gemma 3's local and global layers rotate with different bases: the stack runs it (no fallback), and
    the equality above holds only if each layer got its own caches."""
    arch, runner = stacked
    if arch != "gemma3":
        pytest.skip("one RoPE base")
    assert len(runner.model.model.rotary_embs) == 2
    assert runner.cpu_graph_runner is not None


def test_the_set_is_given_field_by_field() -> None:
    """Windows and soft-caps are arguments (any value); a set must name every LayerArithmetic field, so a
    field added later is outside every stack until someone says what it computes."""
    from radixserve.models.base import ANY_VALUE, LayerArithmetic, LayerArithmeticSet

    gemma2 = LayerArithmetic("sandwich", False, "gelu_tanh", False, False, 4096, 50.0)
    assert gemma2 in DECODE_STACK_LAYERS
    phi3 = LayerArithmetic("pre", False, "silu", False, True, None, None)
    assert phi3 not in DECODE_STACK_LAYERS and DECODE_STACK_LAYERS.outside(phi3) == ["partial_rotary=True"]
    assert "not a record" not in DECODE_STACK_LAYERS
    with pytest.raises(ValueError, match="names every field"):
        LayerArithmeticSet(norms=ANY_VALUE)
