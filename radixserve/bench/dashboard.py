"""bench dashboard: what watching the scheduler costs -- decode tok/s of a fixed load with 0 vs N
connected dashboard streams (GET /v1/stream/metrics, read and parsed as the web page does).

Each round sends --concurrency streamed completions at once (ignore_eos, exactly --max-tokens each,
so every round decodes the same tokens) and measures
    decode tok/s = sum(completion tokens - 1) / (last token of any request - first token of any request)
    output tok/s = completion tokens / round wall time
Rounds alternate 0, N, 0, N, ... dashboards so that drift of a shared machine hits both alike; the
medians and their ratio are printed (1.00x = free). Against --base-url, or a server it starts itself.

    radixserve bench dashboard [--base-url http://127.0.0.1:30000] --dashboards 5 --rounds 5 \
        --concurrency 8 --max-tokens 128 [--json out/dashboard.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

import httpx

from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.server_process import local_radixserve
from radixserve.bench.serving import RequestResult, send_request

PROMPT = "Write a long story about a lighthouse keeper and the ships that pass by at night."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench dashboard", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; default: start one on a free port")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags for the server it starts")
    p.add_argument("--dashboards", type=int, default=5, help="metric streams open during the 'with' rounds")
    p.add_argument("--interval-ms", type=int, default=250, help="each stream's interval (the page's fastest)")
    p.add_argument("--steps", type=int, default=16, help="step records per snapshot (the page's default)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per condition (alternating)")
    p.add_argument("--concurrency", type=int, default=8, help="requests per round, sent at once")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    return p


def _check(args: argparse.Namespace) -> None:
    for name, lo, hi in (("dashboards", 1, 32), ("rounds", 1, 100), ("concurrency", 1, 256),
                         ("max_tokens", 2, 4096), ("interval_ms", 250, 60_000), ("steps", 0, 64)):
        if not lo <= getattr(args, name) <= hi:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]")


# ---------------------------------------------------------------------------- one round
async def _dashboard(client: httpx.AsyncClient, url: str, ready: asyncio.Event, counts: list[int], i: int) -> None:
    """One dashboard: read the stream and parse every snapshot, as the page does."""
    async with client.stream("GET", url) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"metric stream: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                counts[i] += 1
                ready.set()


async def run_round(client: httpx.AsyncClient, base: str, args: argparse.Namespace, dashboards: int) -> dict[str, Any]:
    stream_url = f"{base}/v1/stream/metrics?interval_ms={args.interval_ms}&steps={args.steps}"
    counts = [0] * dashboards
    readies = [asyncio.Event() for _ in range(dashboards)]
    tasks = [asyncio.create_task(_dashboard(client, stream_url, readies[i], counts, i)) for i in range(dashboards)]
    try:
        if tasks:  # every dashboard is live before the load starts
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
        body = {"model": "default", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        url = base + "/v1/completions"
        start = time.perf_counter()
        results = await asyncio.gather(*(send_request(client, url, body, False, RequestResult())
                                         for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
        before = list(counts)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await t
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    # all requests left at `start`: their first / last tokens on one clock
    window = max(r.e2e for r in results) - min(r.ttft for r in results)
    decoded = sum(r.output_tokens - 1 for r in results)
    out = sum(r.output_tokens for r in results)
    return {"dashboards": dashboards, "wall_s": wall, "decode_tok_s": decoded / max(1e-9, window),
            "output_tok_s": out / wall, "completion_tokens": out,
            "snapshots_per_dashboard": statistics.fmean(before) if before else 0.0}


async def run_benchmark(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        warm = await send_request(client, base + "/v1/completions",
                                  {"model": "default", "prompt": PROMPT, "max_tokens": 4, "stream": True}, False,
                                  RequestResult())
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        rounds = []
        for r in range(args.rounds):
            for n in (0, args.dashboards):
                res = await run_round(client, base, args, n)
                res["round"] = r
                rounds.append(res)
                print(f"round {r}: {n} dashboards: decode {res['decode_tok_s']:.1f} tok/s, "
                      f"output {res['output_tok_s']:.1f} tok/s", flush=True)
    return rounds


def summarize_rounds(rounds: list[dict[str, Any]], dashboards: int) -> dict[str, Any]:
    def med(n: int, key: str) -> float:
        return statistics.median(r[key] for r in rounds if r["dashboards"] == n)

    without, with_ = med(0, "decode_tok_s"), med(dashboards, "decode_tok_s")
    return {
        "decode_tok_s_without": without,
        "decode_tok_s_with": with_,
        "decode_ratio": with_ / without,
        "output_tok_s_without": med(0, "output_tok_s"),
        "output_tok_s_with": med(dashboards, "output_tok_s"),
        "output_ratio": med(dashboards, "output_tok_s") / med(0, "output_tok_s"),
        "snapshots_per_dashboard": med(dashboards, "snapshots_per_dashboard"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    _check(args)
    if args.base_url:
        rounds = asyncio.run(run_benchmark(args.base_url.rstrip("/"), args))
    else:
        with local_radixserve(args.server_args.split(), args.api_key) as base:
            rounds = asyncio.run(run_benchmark(base, args))
    summary = summarize_rounds(rounds, args.dashboards)
    print_table([{"dashboards": n, "decode tok/s (median)": summary[f"decode_tok_s_{k}"],
                  "output tok/s (median)": summary[f"output_tok_s_{k}"]}
                 for n, k in ((0, "without"), (args.dashboards, "with"))],
                title=f"bench dashboard: {args.rounds} rounds x {args.concurrency} requests x {args.max_tokens} tokens")
    change = (summary["decode_ratio"] - 1) * 100
    print(f"decode tok/s with {args.dashboards} dashboards / without: {summary['decode_ratio']:.3f}x "
          f"({change:+.1f}%)", flush=True)
    out = {"benchmark": "dashboard", "config": {k: v for k, v in vars(args).items() if k not in ("json", "api_key")},
           "machine": machine_info(), "summary": summary, "rounds": rounds}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
