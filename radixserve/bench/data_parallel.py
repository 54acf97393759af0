"""bench dp: the --load-balance-method choices of a --dp-size N Engine, side by side, on the same workloads.

For each method one Engine (N replicas) is started; each workload then runs on it after a flush_cache
(so every method starts from empty caches and zeroed counters), its requests arriving at --request-rate
per second (Poisson; inf = all at once). Printed per method and workload: duration, requests/s, input
and output tokens/s, mean / p99 end-to-end latency, the prefix-cache hit rate, the requests each replica
served, and the router's own time per request. The last line names the method to make the default:
the highest hit rate on shared-prefix, unless it costs more than 5% of the best throughput on a workload.

    radixserve bench dp --dp-size 2 --workloads shared-prefix,random --request-rate 4 [--dp1-baseline] \
        [--num-groups 6 --group-size 6 --prefix-len 256 ...] [any ServerArgs flag] --json dp.json

On one machine the replicas share its cores (each gets cpu_count // (dp_size * tp_size) threads), so
this compares routing -- cache reuse and queue balance -- not the speed-up more machines would give.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from radixserve.bench.common import print_table, write_json
from radixserve.bench.datasets import add_dataset_args, build_workload, history_ids, workload_summary
from radixserve.bench.offline import engine_kwargs, sampling_params, throughput_metrics
from radixserve.entrypoints.engine import Engine
from radixserve.server_args import LOAD_BALANCE_METHODS, ServerArgs

THROUGHPUT_SLACK = 0.05  # a method within 5% of the best throughput counts as as fast (this box is noisy)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench dp", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--methods", default=",".join(LOAD_BALANCE_METHODS), help="comma-separated methods to compare")
    p.add_argument("--workloads", default="shared-prefix,random", help="comma-separated datasets (see --dataset)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="arrivals per second (inf: all at once)")
    p.add_argument("--dp1-baseline", action="store_true", help="also run the workloads on one replica (dp_size 1)")
    p.add_argument("--json", default=None)
    add_dataset_args(p)
    ServerArgs.add_cli_args(p.add_argument_group("engine (ServerArgs, passed through; --dp-size defaults to 2)"))
    p.set_defaults(dp_size=2)
    return p


async def _arrive(engine: Any, prompts: list[list[int]], params: list[dict[str, Any]], rate: float,
                  seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0

    async def one(ids: list[int], p: dict[str, Any], delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)
        return await engine.async_generate(input_ids=ids, sampling_params=p)

    return list(await asyncio.gather(*(one(i, p, d) for i, p, d in zip(prompts, params, delays))))


def run_workload(engine: Any, convs: list[Any], rate: float, seed: int) -> dict[str, Any]:
    """Single-turn requests (a conversation's first turn, after its shared prefix) on a flushed engine."""
    assert engine.flush_cache(), "flush_cache: the engine was busy"
    before = [r["num_served_reqs"] for r in engine.get_server_info()["dp"]]
    prompts = [history_ids(c, 0, []) for c in convs]
    params = [sampling_params(c.turns[0].output_len) for c in convs]
    t0 = time.perf_counter()
    outs = asyncio.run(_arrive(engine, prompts, params, rate, seed))
    duration = time.perf_counter() - t0
    records = [{"prompt_tokens": o["meta_info"]["prompt_tokens"], "output_tokens": len(o["output_ids"]),
                "cached_tokens": o["meta_info"].get("cached_tokens", 0), "e2e": o["meta_info"].get("e2e_latency")}
               for o in outs]
    info = engine.get_server_info()
    metrics = throughput_metrics(records, duration)
    metrics["cache_hit_rate"] = info["cache_hit_rate"]
    metrics["served_per_replica"] = [r["num_served_reqs"] - b for r, b in zip(info["dp"], before)]
    metrics["route_us_per_req"] = info.get("route_us_per_req", 0.0)
    return metrics


def pick_default(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """The method with the highest shared-prefix hit rate among those within THROUGHPUT_SLACK of the best
    throughput on every workload (the throughput leader when none is)."""
    methods = sorted({r["method"] for r in rows if r["method"] != "dp1"})
    fast = set(methods)
    for wl in {r["workload"] for r in rows}:
        best = max(r["total_tok_s"] for r in rows if r["workload"] == wl and r["method"] in methods)
        fast &= {r["method"] for r in rows if r["workload"] == wl and r["method"] in methods
                 and r["total_tok_s"] >= (1 - THROUGHPUT_SLACK) * best}

    def hit(m: str) -> float:
        return max((r["hit_rate"] for r in rows if r["method"] == m and r["workload"] == "shared-prefix"), default=0.0)

    def tput(m: str) -> float:
        return sum(r["total_tok_s"] for r in rows if r["method"] == m)

    if fast:
        choice = max(fast, key=lambda m: (hit(m), tput(m)))
        why = (f"highest shared-prefix hit rate among the methods within {THROUGHPUT_SLACK:.0%} of the best "
               f"throughput on every workload ({', '.join(sorted(fast))})")
        return choice, why
    choice = max(methods, key=tput)
    return choice, "no method is within the slack everywhere: the highest total throughput"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    base = engine_kwargs(args)
    runs = [(m, base["dp_size"], m) for m in methods] + ([("dp1", 1, methods[0])] if args.dp1_baseline else [])
    rows, results = [], {}
    for label, dp_size, method in runs:
        with Engine(**{**base, "dp_size": dp_size, "load_balance_method": method, "show_progress": False}) as eng:
            eng.generate(input_ids=[[eng.tokenizer.eos_token_id or 0] * 4], sampling_params=sampling_params(2))
            for wl in workloads:
                args.dataset = wl
                convs = build_workload(args, eng.tokenizer)
                m = run_workload(eng, convs, args.request_rate, args.seed)
                results[f"{label}/{wl}"] = {"workload": workload_summary(convs), "metrics": m}
                e2e = m.get("e2e_latency_ms", {})
                rows.append({"method": label, "workload": wl, "duration_s": round(m["duration_s"], 1),
                             "req_s": round(m["request_throughput"], 2),
                             "input_tok_s": round(m["input_throughput"], 1),
                             "output_tok_s": round(m["output_throughput"], 1),
                             "total_tok_s": round(m["total_throughput"], 1),
                             "e2e_mean_ms": round(e2e.get("mean", 0.0)), "e2e_p99_ms": round(e2e.get("p99", 0.0)),
                             "hit_rate": round(m["cache_hit_rate"], 3),
                             "served": "/".join(map(str, m["served_per_replica"])),
                             "route_us": round(m["route_us_per_req"], 1)})
    title = f"bench dp: dp_size {base['dp_size']}, request rate {args.request_rate}/s, {base['num_threads'] or 'auto'} threads"
    print_table(rows, title=title)
    choice, why = pick_default(rows)
    print(f"default --load-balance-method: {choice} ({why})")
    out = {"benchmark": "dp", "rows": rows, "runs": results, "default": choice, "why": why,
           "config": {k: v for k, v in vars(args).items() if k in ("request_rate", "num_requests", "input_len_range",
                      "output_len_range", "num_groups", "group_size", "prefix_len", "question_len", "seed")}}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
