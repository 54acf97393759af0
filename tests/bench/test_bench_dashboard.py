"""bench dashboard against the benchmark tests' server at a tiny size: the rounds alternate, the
'with' rounds really had live dashboards, and the summary is the medians and their ratio."""

from __future__ import annotations

import statistics

import pytest

from radixserve.bench import dashboard
from tests.bench.conftest import API_KEY
from tests.bench.helpers import close, read_json


def test_dashboard_bench_tiny(bench_server, tmp_path) -> None:
    out = tmp_path / "dashboard.json"
    dashboard.main(["--base-url", bench_server.base_url, "--api-key", API_KEY, "--rounds", "2", "--dashboards", "2",
                    "--concurrency", "2", "--max-tokens", "6", "--json", str(out)])
    res = read_json(out)
    rounds, s = res["rounds"], res["summary"]
    assert [r["dashboards"] for r in rounds] == [0, 2, 0, 2]
    for r in rounds:
        assert r["completion_tokens"] == 2 * 6  # ignore_eos: every round decodes the same tokens
        assert r["decode_tok_s"] > 0 and close(r["output_tok_s"], r["completion_tokens"] / r["wall_s"])
        assert (r["snapshots_per_dashboard"] >= 1) == (r["dashboards"] > 0)
    without = statistics.median(r["decode_tok_s"] for r in rounds if r["dashboards"] == 0)
    assert close(s["decode_tok_s_without"], without)
    assert close(s["decode_ratio"], s["decode_tok_s_with"] / s["decode_tok_s_without"])


@pytest.mark.parametrize("flag", [["--dashboards", "0"], ["--max-tokens", "1"], ["--interval-ms", "10"]])
def test_dashboard_bench_refuses_bad_sizes(flag) -> None:
    with pytest.raises(SystemExit):
        dashboard.main(["--base-url", "http://127.0.0.1:9", *flag])
