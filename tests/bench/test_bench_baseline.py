"""bench baseline: transformers' generate (one at a time, static padded batches) and radixserve on
identical token ids, in one run; the session's HF oracle and Engine are reused."""

from __future__ import annotations

import pytest

from radixserve.bench import baseline
from tests.bench.helpers import check_throughputs, close, read_json

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_side_by_side(hf_oracle, tokenizer, bench_engine, tmp_path):
    out = tmp_path / "baseline.json"
    baseline.main(["--dataset", "random", "--num-requests", "3", "--input-len-range", "6,12",
                   "--output-len-range", "2,4", "--batch-size", "2", "--compare-radixserve", "--json", str(out)],
                  model=hf_oracle, tokenizer=tokenizer, engine=bench_engine)
    res = read_json(out)
    rows = {r["engine"]: r for r in res["results"]}
    assert set(rows) == {"hf-one-at-a-time", "hf-static-batch-2", "radixserve"}
    requested = res["workload"]["requested_output_tokens"]
    for r in rows.values():
        assert r["requests"] == 3
        assert r["total_output_tokens"] == requested  # every engine made exactly the asked-for tokens
        assert r["total_input_tokens"] == res["workload"]["new_input_tokens"]  # identical prompts
        check_throughputs(r, "requests")
        for name in ("hf-one-at-a-time", "hf-static-batch-2"):
            assert close(r[f"speedup_vs_{name}"], r["output_throughput"] / rows[name]["output_throughput"])
    assert rows["hf-one-at-a-time"]["generated_tokens"] == requested
    # a static batch runs every row until its longest request ends
    assert rows["hf-static-batch-2"]["generated_tokens"] >= requested


def test_static_batch_left_pads_without_changing_greedy_output(hf_oracle, tokenizer):
    """The padded batch must generate what each prompt generates alone (left padding + mask)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [tokenizer.encode(" The capital of France is", add_special_tokens=False),
               tokenizer.encode(" One two three", add_special_tokens=False)]
    params = [{"max_new_tokens": 3}, {"max_new_tokens": 3}]

    class Bar:
        def update(self, n: int) -> None:
            pass

    alone = baseline.hf_one_at_a_time(hf_oracle, pad, Bar())(prompts, params)
    batched = baseline.hf_static_batches(hf_oracle, pad, 2, Bar())(prompts, params)
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in batched]
