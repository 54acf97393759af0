"""LoRA fixtures: the tiny Llama, its transformers model, and random peft adapters of it."""

from __future__ import annotations

import pytest
import torch

from tests.lora.peft_adapters import make_adapter


@pytest.fixture(scope="session")
def tiny_hf(tiny_llama):
    """(path, transformers model in float32) of the session's tiny Llama."""
    from transformers import AutoModelForCausalLM

    path = tiny_llama(init_std=0.08)  # peaked enough that greedy argmaxes have clear margins
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    return path, model


@pytest.fixture(scope="session")
def tiny_adapters(tiny_hf, tmp_path_factory) -> dict[str, str]:
    """Four adapters of the tiny Llama: different ranks, alphas, targets (q/v only; MLP only), rsLoRA."""
    _, model = tiny_hf
    root = tmp_path_factory.mktemp("tiny-loras")
    specs = {
        "a": {"seed": 1, "r": 8, "alpha": 16.0},
        "b": {"seed": 2, "r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]},
        "c": {"seed": 3, "r": 16, "alpha": 32.0, "targets": ["gate_proj", "up_proj", "down_proj"]},
        "d": {"seed": 4, "r": 8, "alpha": 8.0, "use_rslora": True, "targets": ["k_proj", "o_proj", "up_proj"]},
    }
    return {name: make_adapter(model, str(root / name), std=0.08, **kw) for name, kw in specs.items()}


@pytest.fixture(scope="session")
def lora_runner(tiny_hf, tiny_adapters, default_model_path):
    """A ModelRunner on the tiny Llama in the exact mode with the four adapters loaded."""
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    path, _ = tiny_hf
    args = ServerArgs(model_path=path, tokenizer_path=default_model_path, dtype="float32", quantization="none",
                      max_total_tokens=8192, max_running_requests=32,
                      lora_paths=tuple(f"{n}={p}" for n, p in tiny_adapters.items()), max_loras_per_batch=4,
                      max_loaded_loras=4)
    return ModelRunner(args)


@pytest.fixture(scope="session")
def make_lora_scheduler(lora_runner):
    """An in-process Scheduler over the LoRA runner's weights (a fresh runner each: its own pools and
    adapters), invariant checks on."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    def make(**overrides):
        overrides.setdefault("check_invariants", True)
        args = lora_runner.server_args.replace(**overrides)
        return Scheduler(args, model_runner=ModelRunner(args, model=lora_runner.model))

    return make
