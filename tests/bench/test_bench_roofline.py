"""bench roofline: the measured ceilings are positive and their arithmetic is self-consistent."""

from __future__ import annotations

from radixserve.bench import roofline
from tests.bench.helpers import close, read_json


def test_roofline_cli_writes_consistent_json(tmp_path, model_runner, capsys):
    out = tmp_path / "roofline.json"
    roofline.main(["--rows", "1,8", "--mem-mb", "16", "--min-time", "0.01", "--json", str(out)])
    table = capsys.readouterr().out
    assert "qkv_proj" in table and "copy_gb_per_s" in table
    res = read_json(out)
    cfg = model_runner.model_config
    shapes = roofline.linear_shapes(cfg)
    assert {m["layer"] for m in res["matmul"]} == set(shapes)
    assert len(res["matmul"]) == 2 * len(shapes)  # both row counts are under the LM-head cap
    for m in res["matmul"]:
        assert (m["in"], m["out"]) == shapes[m["layer"]]
        assert m["ms"] > 0 and m["gflops"] > 0 and m["gb_per_s"] > 0
        assert close(m["gflops"], 2 * m["rows"] * m["in"] * m["out"] / (m["ms"] * 1e-3) / 1e9)
    bw = res["bandwidth"]
    assert bw["copy_gb_per_s"] > 0 and bw["reduce_gb_per_s"] > 0
    assert res["bandwidth_gb_per_s"] == max(bw["copy_gb_per_s"], bw["reduce_gb_per_s"])
    assert res["peak_rows"] == 8
    assert res["peak_gflops"] == max(m["gflops"] for m in res["matmul"] if m["rows"] == 8)
    assert close(res["ridge_flops_per_byte"], res["peak_gflops"] / res["bandwidth_gb_per_s"])
    assert res["machine"]["cpu_count"] >= 1


def test_lm_head_only_at_decode_like_rows(model_runner):
    res = roofline.measure_roofline(model_runner.model_config, [1, 128], mem_mb=8, min_s=0.005)
    assert {m["rows"] for m in res["matmul"] if m["layer"] == "lm_head"} == {1}
    # a 1-row GEMM does ~0.5 FLOP per byte it moves: far below the ridge, i.e. memory-bound
    one_row = [m for m in res["matmul"] if m["rows"] == 1]
    assert all(0.4 < m["flops_per_byte"] < 0.6 for m in one_row)
