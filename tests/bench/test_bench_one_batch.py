"""bench one-batch at a tiny size through the session ModelRunner: schema, arithmetic, the plot,
the pools left as found, and the copied decode contexts holding real history."""

from __future__ import annotations

import pytest
import torch

from radixserve.bench import one_batch
from radixserve.bench.runner_driver import RunnerDriver
from tests.bench.helpers import close, read_json

ARGS = ["--prefill-lens", "16,32", "--batch-sizes", "1,2", "--context-lens", "16,24", "--repeats", "1",
        "--roofline-rows", "1,16", "--roofline-min-time", "0.005", "--roofline-mem-mb", "8", "--profile"]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def result(tmp_path_factory, model_runner):
    d = tmp_path_factory.mktemp("one_batch")
    alloc, rows = model_runner.token_to_kv_pool_allocator, model_runner.req_to_token_pool
    free_before = (alloc.available_size(), rows.available_size())
    one_batch.main(ARGS + ["--json", str(d / "ob.json"), "--plot", str(d / "ob.png")], runner=model_runner)
    assert (alloc.available_size(), rows.available_size()) == free_before, "benchmark leaked KV slots or rows"
    return read_json(d / "ob.json"), d / "ob.png"


def test_schema_and_arithmetic(result):
    res, _ = result
    assert [p["prompt_len"] for p in res["prefill"]] == [16, 32]
    for p in res["prefill"]:
        assert p["ms"] > 0 and p["gflops"] > 0
        assert close(p["tokens_per_s"], p["prompt_len"] / p["ms"] * 1e3)
        assert close(p["ms_per_token"], p["ms"] / p["prompt_len"])
        assert close(p["fraction_of_peak_flops"], p["gflops"] / res["roofline"]["peak_gflops"])
    points = {(d["batch_size"], d["context_len"]) for d in res["decode"]}
    assert points == {(1, 16), (2, 16), (1, 24), (2, 24)}
    for d in res["decode"]:
        assert d["decode_step_ms"] > 0
        assert close(d["tokens_per_s"], d["batch_size"] / d["decode_step_ms"] * 1e3)
        assert close(d["step_over_linear_only"], d["decode_step_ms"] / d["linear_only_ms"])
    assert res["skipped"] == []
    assert {"peak_gflops", "bandwidth_gb_per_s", "matmul", "bandwidth"} <= set(res["roofline"])


def test_decode_vs_prefill_and_bandwidth(result):
    res, _ = result
    step1 = {d["context_len"]: d["decode_step_ms"] for d in res["decode"] if d["batch_size"] == 1}
    for r in res["decode_vs_prefill"]:
        assert close(r["ratio"], step1[r["context_len"]] / r["prefill_ms_per_token"])
    for b in res["batch1_decode_bandwidth"]:
        assert b["weight_bytes"] > 0 and b["kv_bytes"] > 0
        assert b["total_bytes"] == b["weight_bytes"] + b["kv_bytes"]
        assert close(b["achieved_gb_per_s"], b["total_bytes"] / (b["decode_step_ms"] * 1e-3) / 1e9)
    assert [lo["rows"] for lo in res["linear_only"]] == [1, 2]


def test_profile_and_plot(result):
    res, png = result
    assert {p["batch_size"] for p in res["profiles"]} == {1, 2}
    for p in res["profiles"]:
        assert p["top"] and p["ops_self_ms"] > 0
        # the linear layers show up, through whichever GEMM the runner uses (MKL or oneDNN packed)
        assert any(op["name"] in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise") for op in p["top"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cloned_context_decodes_like_the_original(model_runner):
    """A copied context is the same history: the next-token logits of a decode step match."""
    drv = RunnerDriver(model_runner, seed=1)
    try:
        template, copy = drv.build_contexts(20, 2)
        other = drv.build_contexts(20, 1)[0]  # a different random history: the control
        token = drv.random_ids(1)
        res = drv.decode([template, copy, other], token * 3)
        logits = res.logits_output.next_token_logits
        # float32 GEMM rows may round differently; a different history differs by far more
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-4)
        assert (logits[0] - logits[2]).abs().max() > 1e-2
        assert not torch.equal(drv.slots(template), drv.slots(copy))  # but in its own slots
    finally:
        drv.release_all()
