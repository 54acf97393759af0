"""Session fixtures: one loaded model shared by every test that needs it.

Imports of radixserve internals stay inside fixtures so that a test module that needs none of
them never pays for them.
"""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: let torch use both, and keep tokenizers from forking thread pools.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from radixserve.model_loader.default_model import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def hf_oracle(default_model_path: str):
    """transformers' own model, loaded from the same GGUF in float32: the correctness oracle."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(default_model_path: str):
    from radixserve.model_loader import get_tokenizer

    return get_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def model_runner(default_model_path: str):
    """The real ModelRunner on the default model in the exact mode (--dtype float32 --quantization none: what
    the transformers oracle is compared with), page_size 1, a modest KV pool."""
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=default_model_path, max_total_tokens=16384, max_running_requests=64,
                      quantization="none", dtype="float32")
    return ModelRunner(args)


@pytest.fixture(scope="session")
def fast_runner(default_model_path: str):
    """The real ModelRunner with the default settings (--quantization auto: the GGUF's own Q4_1 / Q8_0
    blocks for few-row steps, the native decode stack)."""
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    return ModelRunner(ServerArgs(model_path=default_model_path, max_total_tokens=8192, max_running_requests=40))


@pytest.fixture(scope="session")
def make_runner(model_runner):
    """Build another ModelRunner (other page size / pool size) that shares the loaded weights."""
    from radixserve.model_executor.model_runner import ModelRunner

    def make(**overrides):
        args = model_runner.server_args.replace(**overrides)
        return ModelRunner(args, model=model_runner.model)

    return make


@pytest.fixture(scope="session")
def make_scheduler(model_runner):
    """An in-process Scheduler over the shared weights, with invariant checks on."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner

    def make(**overrides):
        overrides.setdefault("check_invariants", True)
        args = model_runner.server_args.replace(**overrides)
        return Scheduler(args, model_runner=ModelRunner(args, model=model_runner.model))

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random-weight Llama saved once per session as a Hugging Face folder (no tokenizer: pair it
    with tokenizer_path=the default model): make(vocab_size, seed, init_std) -> its path. SmolLM2's
    vocabulary (49152) makes it a draft for the default model; a small one (16) makes distributions that
    a chi-square test can check with a few thousand samples."""
    made: dict[tuple[int, int, float], str] = {}

    def make(vocab_size: int = 49152, seed: int = 0, init_std: float = 0.02) -> str:
        key = (vocab_size, seed, init_std)
        if key not in made:
            import transformers

            torch.manual_seed(seed)
            cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=512, initializer_range=init_std)
            path = tmp_path_factory.mktemp(f"tiny-llama-{vocab_size}-{seed}")
            transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
            made[key] = str(path)
        return made[key]

    return make
