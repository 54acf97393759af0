"""bench speculative at a tiny size on the session's weights: every (algorithm, temperature) row is there,
greedy and seeded-ngram outputs equal plain decoding's, the ratios are the tok/s quotients."""

from __future__ import annotations

import pytest

from radixserve.bench import speculative
from tests.bench.helpers import read_json


def test_copy_workload_smoke(fast_runner, tmp_path):
    out = tmp_path / "spec.json"
    res = speculative.main(["--workloads", "copy", "--num-prompts", "2", "--max-new-tokens", "8",
                            "--temperatures", "0,0.7", "--json", str(out)], runner=fast_runner)
    rows = res["rows"]
    assert read_json(out)["rows"] == rows
    assert {(r["algorithm"], r["temperature"]) for r in rows} == {
        ("ngram", 0.0), ("ngram", 0.7), ("draft_model", 0.0), ("draft_model", 0.7)}
    for r in rows:
        assert r["identical_outputs"] is (None if (r["algorithm"], r["temperature"]) == ("draft_model", 0.7) else True)
        # tok/s are printed to 0.1: on a slow or loaded machine that rounding alone moves their ratio
        p, sp = r["plain_tok_s"], r["spec_tok_s"]
        assert r["speedup"] == pytest.approx(sp / p, abs=0.05 * (1 / p + sp / p**2) + 0.01)
    greedy_draft = next(r for r in rows if r["algorithm"] == "draft_model" and r["temperature"] == 0)
    assert greedy_draft["mean_accept_length"] > 2.5  # the model as its own draft: kept ~always


def test_bad_arguments_are_refused():
    for argv in (["--algorithms", "eagle"], ["--workloads", "nope"], ["--max-new-tokens", "0"], ["--num-prompts", "0"]):
        with pytest.raises(SystemExit):
            speculative.main(argv, runner=object())
