"""bench kv-accuracy: a short real run on the default model, and its bounds."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import kv_accuracy


def test_a_short_run_reports_the_int8_drift(tmp_path) -> None:
    out = tmp_path / "acc.json"
    res = kv_accuracy.main(["--prompts", "1", "--positions", "24", "--json", str(out)])
    assert res["positions"] == 24 and 0.8 <= res["top1_agreement"] <= 1.0
    assert 0 < res["mean_abs_dlogprob"] < 0.5  # int8 is not bf16, and not far from it
    assert json.loads(out.read_text())["rows"][0]["KV"] == "int8 (q8_0) vs bf16"


def test_a_float32_reference(tmp_path) -> None:
    """--reference float32: the drift of bf16 itself from a float32 cache, on the same footing as int8's."""
    res = kv_accuracy.main(["--prompts", "1", "--positions", "16", "--reference", "float32", "--kv-dtype", "bfloat16"])
    assert res["positions"] == 16 and res["rows"][0]["KV"] == "bf16 vs float32" and res["mean_abs_dlogprob"] > 0


def test_the_lossless_row_is_a_float32_cache_on_the_same_tokens() -> None:
    """--lossless-row: a float32 cache against the bf16 reference, the agreement no 8-bit cache can pass."""
    res = kv_accuracy.main(["--prompts", "1", "--positions", "12", "--lossless-row"])
    kinds = [r["KV"] for r in res["rows"]]
    assert kinds == ["int8 (q8_0) vs bf16", "float32 vs bf16"]
    assert all(r["positions"] == 12 and 0.5 <= r["top-1 agreement"] <= 1 for r in res["rows"])
    assert res["rows"][1]["mean |Δ logprob|"] > 0  # bf16's own rounding, seen from the exact cache


@pytest.mark.parametrize("args, flag", [(["--prompts", "0"], "--prompts"), (["--prompts", "999"], "--prompts"),
                                        (["--positions", "0"], "--positions"), (["--positions", "1000000000"], "--positions"),
                                        (["--kv-dtype", "bfloat16"], "--kv-dtype bfloat16 is the reference"),
                                        (["--lossless-row", "--kv-dtype", "float32"], "--lossless-row"),
                                        (["--lossless-row", "--reference", "float32"], "--lossless-row")])
def test_bad_arguments_are_refused_by_flag(args, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        kv_accuracy.main(args)


def test_an_unknown_reference_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        kv_accuracy.main(["--reference", "int4"])
    assert "--reference" in capsys.readouterr().err
