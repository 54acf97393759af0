"""bench kv-capacity: one real run on the Gemma 3 file at a small budget, and its bounds."""

from __future__ import annotations

import pytest

from radixserve.bench import kv_capacity


def test_the_hybrid_and_int8_pools_hold_more_and_the_longest_prompt_runs(tmp_path) -> None:
    res = kv_capacity.main(["--kv-budget-gib", "0.01", "--swa-full-tokens-ratio", "0.25",
                            "--json", str(tmp_path / "kv.json")])
    by = {(c["hybrid"], c["kv"]): c for c in res["configs"]}
    one, hybrid = by[False, "bfloat16"], by[True, "bfloat16"]
    assert one["swa"] is None and hybrid["swa"]["swa_tokens"] >= 1088  # two 512-token windows + 64
    # 18 layers, 3 full: at ratio 0.25 a KV slot costs 3 + 15/4 layers' worth instead of 18
    assert hybrid["full_tokens"] / one["full_tokens"] == pytest.approx(18 / 6.75, rel=0.02)
    # q8_0: 34 bytes per 32 values instead of 64 (1.88x; the pool rounds to whole tokens)
    assert by[False, "int8"]["full_tokens"] / one["full_tokens"] == pytest.approx(64 / 34, rel=0.01)
    long = res["long_prompt"]
    assert long["kv"] == "int8" and long["prompt_tokens"] == by[True, "int8"]["full_tokens"] - 64
    assert long["prompt_tokens"] > 4.5 * one["full_tokens"]
    assert long["swa"]["swa_tombstoned_tokens"] > 0  # the prompt's old windows were given up as it ran


@pytest.mark.parametrize("args, flag", [(["--kv-budget-gib", "0"], "--kv-budget-gib"),
                                        (["--kv-budget-gib", "1e9"], "--kv-budget-gib"),
                                        (["--swa-full-tokens-ratio", "0"], "--swa-full-tokens-ratio"),
                                        (["--swa-full-tokens-ratio", "7"], "--swa-full-tokens-ratio"),
                                        (["--kv-dtypes", "int4"], "--kv-dtypes")])
def test_bad_arguments_are_refused_by_flag(args, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        kv_capacity.main(args)
