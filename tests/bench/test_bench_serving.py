"""bench serving against a real `radixserve serve` subprocess: tiny workloads, checked for schema,
exact token counts (ignore_eos + min_tokens + max_tokens) and self-consistent statistics."""

from __future__ import annotations

from radixserve.bench import serving
from radixserve.bench.serving import RequestResult
from tests.bench.conftest import API_KEY
from tests.bench.helpers import check_stats, check_throughputs, read_json

COMMON = ["--api-key", API_KEY, "--output-len-range", "3,6", "--disable-tqdm", "--seed", "3"]


def run(server, tokenizer, tmp_path, *args: str) -> dict:
    out = tmp_path / "serving.json"
    serving.main(["--base-url", server.base_url, *COMMON, *args, "--json", str(out)], tokenizer=tokenizer)
    return read_json(out)


def test_random_completions_with_concurrency(bench_server, tokenizer, tmp_path):
    res = run(bench_server, tokenizer, tmp_path, "--dataset", "random", "--num-requests", "4",
              "--input-len-range", "8,40", "--concurrency", "2", "--save-requests")
    m, w = res["metrics"], res["workload"]
    assert m["completed"] == 4 and m["failed"] == 0 and m["usage_from_server"]
    assert m["total_output_tokens"] == w["requested_output_tokens"]  # exactly what was asked for
    assert m["total_input_tokens"] == w["new_input_tokens"]  # word prompts tokenize back exactly
    check_throughputs(m, "completed")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        check_stats(m[name])
    reqs = res["requests"]
    assert len(reqs) == 4
    for r in reqs:
        assert 0 < r["ttft"] < r["e2e"]
        assert len(r["itl"]) <= r["output_tokens"] - 1  # a chunk carries one token or more
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-9  # last chunk before the stream ends
    assert m["e2e_latency_ms"]["max"] <= m["duration_s"] * 1e3
    assert 0 < m["concurrency"] <= 2 + 1e-6  # never more in flight than --concurrency
    # radixserve reports where its time went: the forward is part of each step, the step part of the wall
    ts = m["server_time_split"]
    assert 0 < ts["forward_s"] < ts["scheduler_step_s"] <= ts["wall_s"] * 1.05
    assert ts["sample_s"] > 0 and ts["tokenizer_process_cpu_s"] > 0
    assert abs(ts["outside_forward_s"] - (ts["scheduler_step_s"] - ts["forward_s"] + ts["tokenizer_process_cpu_s"])) < 1e-9
    assert abs(ts["outside_forward_fraction"] - ts["outside_forward_s"] / ts["wall_s"]) < 1e-9


def test_multi_turn_chat_poisson_reuses_the_cache(bench_server, tokenizer, tmp_path):
    res = run(bench_server, tokenizer, tmp_path, "--endpoint", "chat", "--dataset", "multi-turn",
              "--num-conversations", "2", "--turns", "2", "--input-len-range", "6,12", "--request-rate", "20")
    m = res["metrics"]
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == res["workload"]["requested_output_tokens"]
    # chat template + earlier turns: more prompt tokens than the new user text alone
    assert m["total_input_tokens"] > res["workload"]["new_input_tokens"]
    assert m["total_cached_tokens"] > 0  # turn 2 resends turn 1: the radix cache matches it
    check_throughputs(m, "completed")
    check_stats(m["ttft_ms"])
    assert res["config"]["request_rate"] == 20.0


def test_failed_requests_are_counted_not_raised(bench_server, tokenizer, tmp_path):
    res = run(bench_server, tokenizer, tmp_path, "--dataset", "random", "--num-requests", "2",
              "--input-len-range", "8,8", "--warmup-requests", "0", "--extra-body", '{"temperature": -1}')
    m = res["metrics"]
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["errors"] and "400" in m["errors"][0]
    assert "Infinity" not in (tmp_path / "serving.json").read_text()


def test_token_counts_fall_back_to_the_tokenizer(tokenizer):
    res = RequestResult(ok=True, text=" hello world")
    serving.count_with_tokenizer(res, {"prompt": " one two three"}, tokenizer)
    assert res.prompt_tokens == len(tokenizer.encode(" one two three", add_special_tokens=False))
    assert res.output_tokens == len(tokenizer.encode(" hello world", add_special_tokens=False))
    serving.count_with_tokenizer(res, {"messages": [{"role": "user", "content": "hi"}]}, tokenizer)
    assert res.prompt_tokens > 1  # the chat template's tokens count too
