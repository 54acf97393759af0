"""bench offline on the session Engine: exact token counts, throughput arithmetic, cache reuse."""

from __future__ import annotations

from radixserve.bench import offline
from tests.bench.helpers import check_stats, check_throughputs, read_json


def test_multi_turn_waves(bench_engine, tmp_path):
    out = tmp_path / "offline.json"
    offline.main(["--dataset", "multi-turn", "--num-conversations", "2", "--turns", "2",
                  "--input-len-range", "8,16", "--output-len-range", "2,5", "--json", str(out)], engine=bench_engine)
    res = read_json(out)
    m, w = res["metrics"], res["workload"]
    assert m["requests"] == w["requests"] == 4
    assert m["total_output_tokens"] == w["requested_output_tokens"]
    # turn 2 resends turn 1's prompt and answer: more input than the new text, and cached
    assert m["total_input_tokens"] > w["new_input_tokens"]
    assert m["total_cached_tokens"] > 0
    check_throughputs(m, "requests")
    check_stats(m["e2e_latency_ms"])
    assert m["e2e_latency_ms"]["max"] <= m["duration_s"] * 1e3
    assert res["server_args"]["disable_radix_cache"] is False


def test_shared_prefix_token_counts_are_exact(bench_engine):
    res = offline.main(["--dataset", "shared-prefix", "--num-groups", "2", "--group-size", "2", "--prefix-len", "24",
                        "--question-len", "6", "--output-len-range", "2,3"], engine=bench_engine)
    m, w = res["metrics"], res["workload"]
    assert m["requests"] == 4
    # prompts are sent as token ids: 2 groups x 2 requests x (24 + 6) tokens
    assert m["total_input_tokens"] == 4 * 30
    assert w["new_input_tokens"] == 2 * 24 + 4 * 6  # each prefix counted once as new text
    assert m["total_output_tokens"] == w["requested_output_tokens"]


def test_server_args_pass_through():
    args = offline.build_parser().parse_args(["--disable-radix-cache", "--max-total-tokens", "2048",
                                              "--dataset", "random", "--seed", "5"])
    kw = offline.engine_kwargs(args)
    assert kw["disable_radix_cache"] is True and kw["max_total_tokens"] == 2048
    assert args.seed == 5 and "seed" not in kw  # the workload's seed is not a ServerArgs field
