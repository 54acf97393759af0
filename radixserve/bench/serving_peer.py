"""bench serving-peer: radixserve's server against llama.cpp's llama-server on the same GGUF, the same
workload and the same client (`bench serving`), one after the other in one run, as ratios.

Each server is started here on a free port, measured, and stopped before the other starts, so they
never share the cores. llama-server gets --np parallel slots sharing one -c context (the issue's peer
figure: -np 16 -fa) and the same thread count; radixserve runs with its defaults plus --server-args.
Everything after `--` goes to `bench serving` (its dataset, lengths, concurrency...).

    radixserve bench serving-peer --llama-server /tmp/peer/llama.cpp/build/bin/llama-server --np 16 \
        --threads 2 -- --dataset random --num-requests 64 --input-len-range 200,200 \
        --output-len-range 128,128 --concurrency 32 --seed 0
"""

from __future__ import annotations

import argparse
from typing import Any

from radixserve.bench import serving
from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.datasets import load_tokenizer
from radixserve.bench.server_process import check_binary, local_llama_server, local_radixserve
from radixserve.model_loader import default_model_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench serving-peer", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    p.add_argument("--model-path", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t, and radixserve --num-threads")
    p.add_argument("--np", type=int, default=16, help="llama-server parallel slots (-np)")
    p.add_argument("--ctx", type=int, default=32768, help="llama-server context shared by the slots (-c)")
    p.add_argument("--no-flash-attn", action="store_true", help="llama-server without -fa")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags")
    p.add_argument("--json", default=None)
    p.add_argument("serving_args", nargs=argparse.REMAINDER, help="-- then `bench serving` arguments")
    return p


KEYS = [("output_throughput", "output tok/s", True), ("request_throughput", "requests/s", True),
        ("ttft_ms", "mean TTFT ms", False), ("tpot_ms", "mean TPOT ms", False), ("e2e_latency_ms", "mean E2E ms", False)]


def _figure(metrics: dict[str, Any], key: str) -> float:
    v = metrics[key]
    return float(v["mean"] if isinstance(v, dict) else v)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    rest = [a for a in args.serving_args if a != "--"]
    if any(a == "--base-url" for a in rest):
        raise SystemExit("--base-url: this benchmark starts both servers itself")
    check_binary(args.llama_server, "--llama-server")

    gguf = args.model_path or default_model_path()
    tokenizer = load_tokenizer(None)
    runs: dict[str, dict[str, Any]] = {}
    ours = ["--model-path", gguf, "--num-threads", str(args.threads), *args.server_args.split()]
    with local_radixserve(ours) as base:
        runs["radixserve"] = serving.main([*rest, "--base-url", base, "--disable-tqdm"], tokenizer=tokenizer)
    with local_llama_server(args.llama_server, gguf, args.threads, args.np, args.ctx, not args.no_flash_attn) as base:
        # llama-server ignores min_tokens but honours ignore_eos: both produce exactly max_tokens
        runs["llama.cpp"] = serving.main([*rest, "--base-url", base, "--disable-tqdm"], tokenizer=tokenizer)
    rows = []
    for key, label, higher_better in KEYS:
        a, b = _figure(runs["radixserve"]["metrics"], key), _figure(runs["llama.cpp"]["metrics"], key)
        rows.append({"figure": label, "radixserve": round(a, 2), "llama.cpp": round(b, 2),
                     "radixserve / llama.cpp": round(a / b, 2) if b else None,
                     "better": "higher" if higher_better else "lower"})
    print(f"\n{gguf}  |  llama-server -np {args.np} -c {args.ctx}{'' if args.no_flash_attn else ' -fa'} -t {args.threads}"
          f"  |  radixserve {' '.join(ours[2:])}  |  {machine_info('cpu')}")
    print_table(rows)
    result = {"model": gguf, "runs": {k: v["metrics"] for k, v in runs.items()}, "table": rows,
              "serving_args": rest}
    write_json(args.json, result)
    return result
