"""bench kv-capacity: one real run on the Gemma 3 file at a small budget, and its bounds."""

from __future__ import annotations

import pytest

from radixserve.bench import kv_capacity


def test_the_hybrid_pool_holds_more_and_its_longest_prompt_runs(tmp_path) -> None:
    res = kv_capacity.main(["--kv-budget-gib", "0.03", "--swa-full-tokens-ratio", "0.25",
                            "--json", str(tmp_path / "kv.json")])
    one, hybrid = res["one_pool"], res["hybrid"]
    assert one["swa"] is None and hybrid["swa"]["swa_tokens"] >= 1088  # two 512-token windows + 64
    # 18 layers, 3 full: at ratio 0.25 a KV slot costs 3 + 15/4 layers' worth instead of 18
    assert res["tokens_gain"] == pytest.approx(18 / 6.75, rel=0.02)
    long = res["long_prompt"]
    assert long["prompt_tokens"] == hybrid["full_tokens"] - 64 > 2 * one["full_tokens"]
    assert long["swa"]["swa_tombstoned_tokens"] > 0  # the prompt's old windows were given up as it ran


@pytest.mark.parametrize("args, flag", [(["--kv-budget-gib", "0"], "--kv-budget-gib"),
                                        (["--kv-budget-gib", "1e9"], "--kv-budget-gib"),
                                        (["--swa-full-tokens-ratio", "0"], "--swa-full-tokens-ratio"),
                                        (["--swa-full-tokens-ratio", "7"], "--swa-full-tokens-ratio")])
def test_bad_arguments_are_refused_by_flag(args, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        kv_capacity.main(args)
