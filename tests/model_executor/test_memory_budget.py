"""One memory budget (model_executor/memory_budget.py) and a GGUF loaded from its mapped file without a float32
pass (model_loader/gguf_loader.py): the default model's load peaks at the file + the KV pool + a small fixed
overhead of anonymous memory, measured in a fresh process; a model that does not fit is refused before anything
is allocated, with the sizes; an absurd KV pool size is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_executor.memory_budget import GIB, MemoryBudget
from radixserve.server_args import ServerArgs

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")

# RssAnon sampled every 2 ms on a thread while the runner is built, from a baseline taken with torch, the package
# and the C++ kernels already loaded: what the load itself adds
_PROBE = r"""
import json, sys, threading, time
def anon():
    with open('/proc/self/status') as fh:
        for line in fh:
            if line.startswith('RssAnon'):
                return int(line.split()[1]) * 1024
from radixserve.kernels.cpu import load_cpu_ops
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
load_cpu_ops()
base = anon(); peak = [base]; done = []
def poll():
    while not done:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
t = threading.Thread(target=poll, daemon=True); t.start()
out = {"base": base}
try:
    r = ModelRunner(ServerArgs(**json.loads(sys.argv[1])))
    out.update(kv=r.memory_budget.kv_pool, weights=r.weight_bytes, budget=r.memory_budget.as_dict())
except ValueError as e:
    out["error"] = str(e)
done.append(1); t.join()
out["peak"] = max(peak[0], anon())
print("PROBE " + json.dumps(out))
"""

FIXED_OVERHEAD = 96 << 20  # the model skeleton, norms, rotary tables, the light GGUF parse, one layer's work


def _probe(**kwargs) -> dict:
    env = {**os.environ, "RADIXSERVE_LOG_LEVEL": "warning"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(kwargs)], capture_output=True, text=True, check=False,
                          timeout=600, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert line, proc.stderr[-3000:]
    return json.loads(line[0][6:])


def test_loading_the_default_model_peaks_at_the_file_plus_the_kv_pool(default_model_path) -> None:
    """The old path dequantised the whole model to float32 (~0.55 GB here, ~30 GB for an 8B) before packing it:
    ~1.1 GB over the baseline. Now the low-bit blocks go from the mapped file to the kernels' layout one layer at
    a time and the embedding is read in place."""
    got = _probe(model_path=default_model_path, max_total_tokens=4096)
    assert "error" not in got, got
    file_bytes = os.path.getsize(default_model_path)
    grew = got["peak"] - got["base"]
    # the kernels' layout keeps Q4_1's scales in float32: ~1.15x the file's bytes
    assert grew <= 1.2 * file_bytes + got["kv"] + FIXED_OVERHEAD, (grew >> 20, file_bytes >> 20, got["kv"] >> 20)
    assert got["weights"] <= 1.2 * file_bytes
    b = got["budget"]
    assert b["kv_pool_tokens"] == 4096 and b["weights_bytes"] + b["kv_pool_bytes"] + b["activations_bytes"] \
        <= b["budget_bytes"]


def test_a_model_that_does_not_fit_is_refused_before_anything_is_allocated(default_model_path) -> None:
    got = _probe(model_path=default_model_path, mem_fraction_static=0.001)
    assert "does not fit in memory" in got.get("error", ""), got
    assert "weights 0.09 GiB" in got["error"] and "mem_fraction_static 0.001" in got["error"]
    assert got["peak"] - got["base"] < 24 << 20  # not one layer's blocks, let alone the model's


def test_the_exact_mode_names_its_float32_size_and_the_way_out(default_model_path) -> None:
    from radixserve.model_executor.model_runner import ModelRunner

    with pytest.raises(ValueError, match=r"the exact mode \(--quantization none\) needs 0\.5\d GiB of float32 "
                                         r"weights; .* use --quantization auto"):
        ModelRunner(ServerArgs(model_path=default_model_path, quantization="none", mem_fraction_static=0.001))


@pytest.mark.parametrize("tokens", [10**12, 2**62])
def test_an_absurd_kv_pool_is_refused_by_name(default_model_path, tokens) -> None:
    from radixserve.model_executor.model_runner import ModelRunner

    with pytest.raises(ValueError, match=rf"max_total_tokens {tokens} needs a KV pool of"):
        ModelRunner(ServerArgs(model_path=default_model_path, max_total_tokens=tokens))


def test_the_kv_pool_gets_what_is_left_capped() -> None:
    b = MemoryBudget(available=10 * GIB, fraction=0.5, weights=3 * GIB, activations=GIB)
    assert b.left() == GIB
    assert b.size_kv_pool(per_token=1 << 20, cap_bytes=None, fixed_tokens=None, page_size=16) == 1024
    assert b.size_kv_pool(per_token=1 << 20, cap_bytes=GIB // 4, fixed_tokens=None, page_size=16) == 256
    assert b.size_kv_pool(per_token=1 << 20, cap_bytes=None, fixed_tokens=1000, page_size=16) == 1000
    with pytest.raises(ValueError, match="max_total_tokens 1025 needs a KV pool of 1.00 GiB"):
        b.size_kv_pool(per_token=1 << 20, cap_bytes=None, fixed_tokens=1025, page_size=16)
    assert not b.float_copy_fits(GIB, min_kv_bytes=1)
    assert b.float_copy_fits(GIB // 2, min_kv_bytes=GIB // 2)
    with pytest.raises(ValueError, match=r"needs 5\.50 GiB .* the budget is 5\.00 GiB"):
        MemoryBudget(available=10 * GIB, fraction=0.5, weights=4 * GIB, activations=GIB // 2).check_weights_fit(GIB)


def test_long_steps_get_a_float_copy_built_from_the_file(fast_runner, model_runner) -> None:
    """quant_max_rows set (AMX's bf16 long steps; float32 here): each low-bit layer also gets float weights,
    dequantised from the file layer by layer: exactly the exact mode's, packed for the float GEMM at once."""
    import torch

    from radixserve.layers.linear import PackableLinear
    from radixserve.model_executor.model_runner import ModelRunner

    runner = ModelRunner(fast_runner.server_args.replace(quant_max_rows=8, max_total_tokens=2048, dtype="float32"))
    assert runner.quant_max_rows == 8 and runner.memory_budget.float_copy > 0
    exact = dict(model_runner.model.named_modules())
    x = torch.randn(40, model_runner.model_config.hidden_size)
    checked = 0
    for name, mod in runner.model.named_modules():
        if isinstance(mod, PackableLinear) and mod.qweight is not None:
            assert mod.packed is not None or mod.weight is not None, name
            if name.endswith("o_proj") or name == "lm_head":
                assert torch.equal(mod._gemm(x[:, : mod.weight_dims()[1]], None),
                                   exact[name]._gemm(x[:, : mod.weight_dims()[1]], None)), name
                checked += 1
    assert checked == 31
