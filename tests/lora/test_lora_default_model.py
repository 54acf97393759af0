"""LoRA on the default model (SmolLM2-135M, GGUF Q4_1): a peft adapter made on transformers' own model of the
same file gives peft's tokens and logprobs in the exact mode (beside base requests in one batch); with the
default settings the base projections keep running on the file's low-bit kernels, the float delta on top,
and steps without adapter rows pay nothing."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_driver import assert_matches, reference, run
from tests.lora.peft_adapters import make_adapter, peft_reference


@pytest.fixture(scope="module")
def smol_adapter(hf_oracle, tmp_path_factory) -> str:
    return make_adapter(hf_oracle, str(tmp_path_factory.mktemp("smol-lora") / "s"), seed=21, r=8, alpha=16.0,
                        std=0.03)


@pytest.fixture(scope="module")
def smol_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in ("The capital of France is", "A radix tree")]


def test_default_model_adapter_matches_peft_exact(model_runner, hf_oracle, smol_adapter, smol_prompts):
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    args = model_runner.server_args.replace(lora_paths=(f"s={smol_adapter}",), check_invariants=True)
    sched = Scheduler(args, model_runner=ModelRunner(args, model=model_runner.model))
    peft_model = peft_reference(hf_oracle, smol_adapter)
    reqs = {f"s{i}": (p, "s") for i, p in enumerate(smol_prompts)} | {"base": (smol_prompts[0], None)}
    out = run(sched, reqs, n=5)
    for i, p in enumerate(smol_prompts):
        assert_matches(out[f"s{i}"], reference(peft_model, p, 5), what=f"smol adapter {i}")
    assert_matches(out["base"], reference(hf_oracle, smol_prompts[0], 5), what="smol base")


def test_low_bit_base_with_float_delta_on_top(fast_runner, smol_adapter):
    """A Q4_1 projection in the low-bit mode plus an adapter row group: exactly the kernel's output plus
    (x A^T) B^T on the adapter's rows; the other rows, and a step with no LoRABatch, are the kernel's own."""
    from types import SimpleNamespace

    from radixserve.layers.kernel_mode import KernelMode
    from radixserve.lora.lora_adapter import load_adapter, read_lora_config
    from radixserve.lora.lora_batch import LoRABatch, install_lora_hooks, torch_lora_apply

    model = fast_runner.model
    name, proj = next((n, m) for n, m in model.named_modules() if n.endswith("layers.0.self_attn.qkv_proj"))
    assert proj.qweight is not None and fast_runner.quant_ops is not None  # the file's low-bit blocks
    install_lora_hooks(model)
    cfg = read_lora_config("s", smol_adapter, 64)
    adapter = load_adapter(cfg, model, 1, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    x = torch.randn(5, proj.weight_dims()[1])
    # a stand-in for the step's ForwardBatch: the two fields a projection reads from it
    def step(lora_batch: LoRABatch | None) -> SimpleNamespace:
        return SimpleNamespace(kernel_mode=KernelMode(fast_runner.quant_ops, None), lora_batch=lora_batch)

    plain = proj(x, step(None))
    assert torch.equal(proj(x, step(None)), plain)  # base-only: untouched
    batch = LoRABatch.build([None, adapter, None], [2, 2, 1], torch.device("cpu"), torch_lora_apply)
    mixed = proj(x, step(batch))
    w = adapter.weights[name]
    want = plain.clone()
    want[2:4] += (x[2:4] @ w.A.t()) @ w.B.t()
    assert torch.allclose(mixed, want, atol=1e-5) and not torch.allclose(mixed[2:4], plain[2:4])
    assert torch.equal(mixed[[0, 1, 4]], plain[[0, 1, 4]])


def test_default_settings_serve_adapter_and_base_together(fast_runner, smol_adapter, smol_prompts):
    """--quantization auto (low-bit kernels, the native decode stack): base requests beside adapter requests
    give what the base gives alone; the adapter changes the output."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    args = fast_runner.server_args.replace(lora_paths=(f"s={smol_adapter}",), check_invariants=True)
    sched = Scheduler(args, model_runner=ModelRunner(args, model=fast_runner.model))
    alone = run(sched, {"base": (smol_prompts[1], None)}, n=6)
    both = run(sched, {"s": (smol_prompts[1], "s"), "base2": (smol_prompts[1], None)}, n=6)
    assert both["base2"].ids == alone["base"].ids
    # the adapter is applied (its small random weights move the logprobs, not always the argmax)
    assert max(abs(a - b) for a, b in zip(both["s"].logprobs, alone["base"].logprobs)) > 1e-3


@pytest.fixture(scope="module")
def smol_adapters(hf_oracle, tmp_path_factory) -> list[str]:
    """Three adapters of different ranks; the last targets attention only."""
    root = tmp_path_factory.mktemp("smol-loras")
    return [make_adapter(hf_oracle, str(root / f"a{i}"), seed=30 + i, r=r, alpha=2.0 * r, std=0.03, targets=t)
            for i, (r, t) in enumerate([(8, None), (16, None), (4, ["q_proj", "v_proj", "o_proj"])])]


def test_the_decode_stack_adds_the_deltas_bit_for_bit(fast_runner, smol_adapters, smol_prompts, caplog):
    """Decode and ngram-verify steps with adapter rows run inside the native decode stack (DecodeStack.forward_lora)
    and give exactly the tokens and logprobs of the layer-by-layer path over the same low-bit weights: one
    adapter, three of different ranks and targets beside base requests, and a long prefill (more rows than the
    dense path takes) that runs layer by layer, said once in the log."""
    import logging

    from radixserve.lora.lora_dense import ROW_LIMIT
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    if fast_runner.cpu_graph_runner is None:
        pytest.skip("no native decode stack on this machine (C++ kernels unavailable)")
    long_prompt = (smol_prompts[0] * (ROW_LIMIT // len(smol_prompts[0]) + 2))[: ROW_LIMIT + 9]
    reqs = {"one": (smol_prompts[0], "a0"), "two": (smol_prompts[1], "a1"), "three": (smol_prompts[1], "a2"),
            "base": (smol_prompts[0], None), "long": (long_prompt, "a1")}
    outs = {}
    for label, extra in [("stack", {}), ("layers", {"disable_cpu_graph": True}),
                         ("stack_ngram", {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}),
                         ("layers_ngram", {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3,
                                           "disable_cpu_graph": True})]:
        args = fast_runner.server_args.replace(lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(smol_adapters)),
                                               check_invariants=True, **extra)
        with caplog.at_level(logging.INFO, logger="radixserve.lora.runner_setup"):
            caplog.clear()
            sched = Scheduler(args, model_runner=ModelRunner(args, model=fast_runner.model))
            alone = run(sched, {"one": reqs["one"]}, n=7)  # a step of one adapter alone
            outs[label] = alone | run(sched, {k: v for k, v in reqs.items() if k != "one"}, n=7)
        graph = sched.model_runner.cpu_graph_runner
        if graph is not None:
            # the decode (or verify) steps of both runs went through the stack
            assert graph.lora_replays >= (2 if "ngram" in label else 12), graph.lora_replays
            assert sum("run layer by layer" in r.getMessage() for r in caplog.records) == 1  # the long prefill
    for rid in reqs:
        for a, b in (("stack", "layers"), ("stack_ngram", "layers_ngram")):
            assert outs[a][rid].ids == outs[b][rid].ids, (rid, a)
            assert outs[a][rid].logprobs == outs[b][rid].logprobs, (rid, a)  # equal floats, not close ones
    assert outs["stack"]["three"].logprobs != outs["stack"]["two"].logprobs  # each row got its own adapter
