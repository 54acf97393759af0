"""The native decode stack binds a model by the arithmetic its layers declare (LayerArithmetic), never by
attribute names: a Llama-shaped Qwen2 with low-bit weights runs on it; a model with a sliding window or
soft-capped sandwich layers keeps the layer-by-layer path, and the reason names the layer's arithmetic."""

from __future__ import annotations

import pytest

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from tests.models.test_architectures import make_hf_model

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")


@pytest.mark.parametrize("arch,bound,reason", [
    ("qwen2_yarn", True, None),
    ("mistral_window", False, "sliding_window=5"),
    ("gemma2", False, "sandwich"),
])
def test_stack_follows_the_declared_arithmetic(tmp_path, arch, bound, reason) -> None:
    make_hf_model(arch, tmp_path)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), quantization="int8", dtype="float32",
                                    max_total_tokens=512, max_running_requests=2))
    assert (runner.cpu_graph_runner is not None) == bound
    if reason is not None:
        assert reason in CpuGraphRunner._unsupported(runner)
