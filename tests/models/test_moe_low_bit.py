"""A MoE GGUF in the default mode: the experts keep the file's own low-bit blocks (3-D ffn_*_exps tensors of
three types: gate Q4_0, up Q5_1, down Q8_0) and run through the fused-experts kernel (csrc/fused_experts.cpp),
against the exact mode on the same file. The blocks are the file's values exactly (no re-quantisation), the
float copies are released where every step runs low-bit, a request's logprobs do not depend on its batch,
and the default mode's next tokens agree with the exact mode's."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch
from tests.models.moe_models import make_moe_model
from tests.models.test_architectures import _prompts
from tests.models.test_moe_gguf import write_moe_gguf

QUANT = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q5_1", "ffn_down_exps": "Q8_0"}

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")  # the default and deterministic modes need them


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-low-bit")
    model = make_moe_model("qwen3_moe", folder / "hf")
    path = folder / "model.gguf"
    write_moe_gguf(model, "qwen3moe", path, quant=QUANT)
    common = dict(model_path=str(path), max_total_tokens=2048, max_running_requests=8)
    exact = ModelRunner(ServerArgs(**common, dtype="float32", quantization="none"))
    fast = ModelRunner(ServerArgs(**common))  # the default mode
    return exact, fast


def _logprobs(runner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced next-token logprobs of every position, the prompts prefilled in one batch."""
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    out = hb.split(hb.all_logprobs(hb.run(list(zip(rows, prompts)))), [len(p) for p in prompts])
    hb.release_all()
    return out


def test_experts_keep_the_files_blocks(runners) -> None:
    exact, fast = runners
    assert fast.quantization == "auto"
    blocks = list(fast.model.moe_blocks())
    assert len(blocks) == 3
    for block, ref in zip(blocks, exact.model.moe_blocks()):
        ex = block.experts
        assert ex.low_bit is not None
        w13, w2 = ex.low_bit
        # gate Q4_0 (Q4_1's layout) and up Q5_1 (Q5) stack in their join, Q5; down Q8_0 as it is
        assert (w13.name, w2.name) == ("Q5", "Q8_0")
        for e in range(ex.num_local):
            assert torch.equal(w13.expert(e).dequantize(), ref.experts.w13[e])
            assert torch.equal(w2.expert(e).dequantize(), ref.experts.w2[e])
        # every step low-bit (the default on every CPU kind): the float experts are gone
        assert fast.quant_max_rows is None and ex.w13 is None
    assert fast.quant_report.counts.get("Q5", 0) >= 3 and fast.quant_report.counts.get("Q8_0", 0) >= 3


def test_default_mode_agrees_with_the_exact_mode(runners) -> None:
    exact, fast = runners
    prompts = _prompts(11, (40, 17, 29))
    agree = total = 0
    worst = 0.0
    for a, b in zip(_logprobs(exact, prompts), _logprobs(fast, prompts)):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        worst = max(worst, float((a - b).abs().max()))
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert worst < 0.5, f"max |logprob difference| {worst:.3f}"  # int8 activations, not a wrong expert


def test_a_requests_logprobs_do_not_depend_on_its_batch(runners) -> None:
    """Every step low-bit (the default on every CPU kind, AMX included), the experts' rows never meet."""
    _, fast = runners
    prompts = _prompts(12, (23, 9, 31, 5))
    batched = _logprobs(fast, prompts)
    for i in (0, 3):
        alone = _logprobs(fast, [prompts[i]])[0]
        assert torch.equal(alone, batched[i])


def test_deterministic_mode_is_batch_invariant_through_the_experts(tmp_path) -> None:
    """--enable-deterministic-inference (float experts, fixed row tiles): a request's logprobs are bit for
    bit the same alone and beside others that load its experts with more rows."""
    make_moe_model("mixtral", tmp_path / "hf", skewed=True)  # every token picks the hot expert: its GEMM grows
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "hf"), max_total_tokens=2048, max_running_requests=8,
                                    enable_deterministic_inference=True))
    prompts = _prompts(13, (21, 7, 33, 12, 40))
    batched = _logprobs(runner, prompts)
    for i in (1, 4):
        assert torch.equal(_logprobs(runner, [prompts[i]])[0], batched[i])
