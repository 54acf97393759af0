"""--quantization int8: the C++ int8 x int8 kernel against a float reference, its bad inputs, the
one-row dispatch, and a model whose shapes do not fit the kernel's blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.linear import Q8_BLOCK, PackableLinear, int8_rows_mode

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None or not hasattr(ops, "int8_linear"), reason=f"no C++ kernels: {why}")


def _quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, PackableLinear]:
    g = torch.Generator().manual_seed(seed)
    lin = PackableLinear()
    lin.weight = torch.nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
    lin.quantize_int8("test")
    return lin.weight.detach().clone(), lin


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), blocks=st.integers(1, 12), m=st.integers(1, 3), bias=st.booleans(),
       seed=st.integers(0, 1000))
def test_kernel_matches_the_dequantised_reference(n, blocks, m, bias, seed) -> None:
    k = blocks * Q8_BLOCK
    _, lin = _quantized(n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = torch.empty(m, n)
    ops.int8_linear(x, lin.q8_weight, lin.q8_scale, b, out)
    # reference: the same block quantisation of x, in float
    xb = x.reshape(m, blocks, Q8_BLOCK)
    xs = xb.abs().amax(2, keepdim=True) / 127
    xq = torch.round(xb / xs.clamp(min=1e-30)) * xs
    wd = (lin.q8_weight.float().reshape(n, blocks, Q8_BLOCK) * lin.q8_scale[:, :, None]).reshape(n, k)
    ref = xq.reshape(m, k) @ wd.T + (b if b is not None else 0)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)


def test_quantisation_error_is_small() -> None:
    w, lin = _quantized(256, 576, 0)
    wd = (lin.q8_weight.float().reshape(256, -1, Q8_BLOCK) * lin.q8_scale[:, :, None]).reshape(256, 576)
    assert ((wd - w).abs().max() / w.abs().max()).item() < 1 / 254 + 1e-6


def test_bad_shapes_are_refused() -> None:
    lin = PackableLinear()
    lin.weight = torch.nn.Parameter(torch.randn(8, 48), requires_grad=False)
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.down_proj .*8x48.*not a multiple of .*32"):
        lin.quantize_int8("model.layers.0.mlp.down_proj")
    _, ok = _quantized(8, 64, 0)
    with pytest.raises(RuntimeError, match="multiple of 32|must be int8"):
        ops.int8_linear(torch.randn(1, 40), ok.q8_weight[:, :40].contiguous(), ok.q8_scale, None, torch.empty(1, 8))


def test_only_one_row_steps_take_the_int8_path() -> None:
    w, lin = _quantized(64, 128, 3)
    x1, x4 = torch.randn(1, 128), torch.randn(4, 128)
    exact1, exact4 = lin.matmul(x1), lin.matmul(x4)  # no mode: float32
    torch.testing.assert_close(exact1, x1 @ w.T)
    with int8_rows_mode(ops):
        q1, q4 = lin.matmul(x1), lin.matmul(x4)
    assert not torch.equal(q1, exact1)  # the int8 kernel ran
    torch.testing.assert_close(q1, exact1, atol=0.1, rtol=0.05)
    assert torch.equal(q4, exact4)  # four rows stay on the float32 path


def test_server_args_bounds() -> None:
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int8", enable_deterministic_inference=True)
