"""bench offline: radixserve.Engine throughput on a fixed workload, no HTTP.

The same scheduler and ModelRunner as the server, driven from Python with every request of a
wave submitted at once, so the scheduler can batch as much as the KV pool allows: this is the
ceiling the seed's argument predicts (decode steps of a large batch cost about as much as a step
of one request, so output tokens/s grows with the batch), without HTTP, SSE or tokenisation of
the prompt in the way. Prompts are sent as token ids, so input counts are exact.

multi-turn runs in waves: turn k of every conversation is submitted together once turn k-1 of all
of them has finished, each prompt being the previous prompt + its answer's token ids + a new
message (what the radix cache matches: `cached_tokens`). Compare with --disable-radix-cache.

    radixserve bench offline --dataset shared-prefix --num-groups 4 --group-size 16 \
        [--disable-radix-cache] [any ServerArgs flag] --json offline.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixserve.bench.common import print_kv, summarize, write_json
from radixserve.bench.datasets import (
    Conversation,
    add_dataset_args,
    build_workload,
    history_ids,
    load_tokenizer,
    workload_summary,
)
from radixserve.entrypoints.engine import Engine
from radixserve.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench offline", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--warmup-requests", type=int, default=1, help="short untimed requests first")
    p.add_argument("--json", default=None)
    add_dataset_args(p)
    ServerArgs.add_cli_args(p.add_argument_group("engine (ServerArgs, passed through)"))
    return p


def sampling_params(output_len: int, ignore_eos: bool = True) -> dict[str, Any]:
    """Greedy, exactly `output_len` tokens (EOS ignored), as every benchmark asks for."""
    params: dict[str, Any] = {"max_new_tokens": output_len, "temperature": 0.0}
    if ignore_eos:
        params.update(ignore_eos=True, min_new_tokens=output_len)
    return params


def run_waves(generate: Any, convs: list[Conversation]) -> list[dict[str, Any]]:
    """Turn k of every conversation as one batch; `generate(list_of_ids, list_of_params)` returns
    one {"output_ids", "meta_info"} dict per prompt. Returns one record per request."""
    answers: list[list[list[int]]] = [[] for _ in convs]
    records = []
    for k in range(max(c.num_requests for c in convs)):
        idx = [i for i, c in enumerate(convs) if k < c.num_requests]
        prompts = [history_ids(convs[i], k, answers[i]) for i in idx]
        params = [sampling_params(convs[i].turns[k].output_len) for i in idx]
        outs = generate(prompts, params)
        for i, prompt, out in zip(idx, prompts, outs):
            answers[i].append(list(out["output_ids"]))
            meta = out.get("meta_info", {})
            records.append({
                "conversation": i, "turn": k,
                "prompt_tokens": int(meta.get("prompt_tokens", len(prompt))),
                "output_tokens": int(meta.get("completion_tokens", len(out["output_ids"]))),
                "cached_tokens": int(meta.get("cached_tokens", 0)),
                "e2e": meta.get("e2e_latency"),
            })
    return records


def throughput_metrics(records: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    n_in = sum(r["prompt_tokens"] for r in records)
    n_out = sum(r["output_tokens"] for r in records)
    metrics: dict[str, Any] = {
        "requests": len(records),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "total_cached_tokens": sum(r["cached_tokens"] for r in records),
        "request_throughput": len(records) / duration,
        "input_throughput": n_in / duration,
        "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration,
    }
    # NOTE: no TTFT here: a non-streaming request's tokens reach the caller together at the end.
    vals = [r["e2e"] for r in records if r.get("e2e") is not None]
    if vals:
        metrics["e2e_latency_ms"] = summarize(vals, 1e3)
    return metrics


def run_engine(engine: Any, convs: list[Conversation], warmup_requests: int = 1) -> dict[str, Any]:
    """Time the workload on a started Engine (the warm-up is not timed and shares no prefix)."""
    for _ in range(warmup_requests):
        engine.generate(input_ids=[[engine.tokenizer.eos_token_id or 0] * 4], sampling_params=[sampling_params(2)])

    def generate(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return engine.generate(input_ids=prompts, sampling_params=params)

    t0 = time.perf_counter()
    records = run_waves(generate, convs)
    duration = time.perf_counter() - t0
    return {"metrics": throughput_metrics(records, duration), "records": records}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(args, f.name) for f in fields(ServerArgs)}


def main(argv: list[str] | None = None, engine: Any = None) -> dict[str, Any]:
    """`engine`: an already started Engine to reuse (its own ServerArgs then apply, not the flags)."""
    args = build_parser().parse_args(argv)
    own = engine is None
    if own:
        engine = Engine(**engine_kwargs(args))
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else engine.tokenizer
        convs = build_workload(args, tokenizer)
        run = run_engine(engine, convs, args.warmup_requests)
        server_args = engine.server_args
    finally:
        if own:
            engine.shutdown()
    out = {
        "benchmark": "offline",
        "model": server_args.model_name(),
        "server_args": {k: v for k, v in vars(server_args).items() if k != "api_key"},
        "config": {k: v for k, v in vars(args).items() if k in ("dataset", "num_requests", "input_len_range",
                   "output_len_range", "num_groups", "group_size", "prefix_len", "question_len",
                   "num_conversations", "turns", "seed")},
        "workload": workload_summary(convs),
        "metrics": run["metrics"],
    }
    flat = {k: v for k, v in run["metrics"].items() if not isinstance(v, dict)}
    for stat in ("mean", "median", "p99"):
        if "e2e_latency_ms" in run["metrics"]:
            flat[f"{stat} e2e_latency_ms"] = run["metrics"]["e2e_latency_ms"][stat]
    radix = "off" if server_args.disable_radix_cache else "on"
    print_kv(flat, title=f"offline Engine: {args.dataset} ({out['model']}, radix cache {radix})")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
