"""bench one-batch: the cost of one forward step, prefill vs decode, through the real ModelRunner.

The seed's argument, measured on this machine (no scheduler: every step is a ModelWorkerBatch ->
ForwardBatch.init_new -> ModelRunner.forward -> sample, built by hand through the real pools):

  * prefill is one big GEMM: time per prompt token falls as the prompt grows, and its achieved
    FLOP/s approaches the matmul roofline (`bench roofline`, measured in the same run);
  * a decode step is a tiny GEMM bounded by memory traffic: batch-1 step time is compared with
    (weights + KV read) / measured bandwidth, and with the model's linear layers alone at one row;
  * decode per-token time / prefill per-token time is the seed's "300x" figure, measured here;
  * batching decode is nearly free: step time vs batch size stays flat while tokens/s grows,
    until the KV cache runs out;
  * decode slows as the context grows: one line per context length in the plot.

Contexts hold real K/V (one prompt prefilled per context length, copied into each request's own
slots; see runner_driver.py), so attention reads real history of the stated length.

    radixserve bench one-batch --prefill-lens 128,256,512,1024,2048 --batch-sizes 1,2,4,8,16,32,64 \
        --context-lens 128,512,2048 --json one_batch.json --plot one_batch.png [--profile]
        [--enable-deterministic-inference] [--quantization int8]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch

from radixserve.bench import decode_profile, model_cost
from radixserve.bench.common import machine_info, parse_int_list, print_table, synchronize, write_json
from radixserve.bench.roofline import measure_roofline
from radixserve.bench.runner_driver import RunnerDriver
from radixserve.bench.step_profile import profile_step
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import get_model_config
from radixserve.server_args import ServerArgs
from radixserve.server_args_checks import KV_CACHE_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench one-batch", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--prefill-lens", type=parse_int_list, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--batch-sizes", type=parse_int_list, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context-lens", type=parse_int_list, default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--decode-repeats", type=int, default=0,
                   help="timed steps per decode point (default --repeats); a few-ms step on a shared machine needs "
                        "dozens for a steady median (bench peer takes 64)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size (default: exactly what the largest batch x context needs)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--roofline-rows", type=parse_int_list, default=[1, 32, 512])
    p.add_argument("--roofline-min-time", type=float, default=0.2)
    p.add_argument("--roofline-mem-mb", type=int, default=256)
    p.add_argument("--profile", action="store_true",
                   help="split a batch-1 decode step (scheduler, Python, each kernel family with its GB/s: "
                        "bench/decode_profile.py) at each context length, and torch.profiler over one decode step "
                        "at the smallest and largest batch")
    p.add_argument("--profile-steps", type=int, default=64, help="decode steps the batch-1 split averages over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="ServerArgs.quantization to measure (none with --dtype float32 = the exact mode)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="ServerArgs.dtype (the GEMMs' dtype; auto = bf16 on AMX / AVX512-BF16 CPUs)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="ServerArgs.kv_cache_dtype")
    p.add_argument("--quant-max-rows", type=int, default=None,
                   help="ServerArgs.quant_max_rows (which steps run the low-bit copy; default auto)")
    p.add_argument("--disable-cpu-graph", action="store_true",
                   help="decode layer by layer in Python (ServerArgs.disable_cpu_graph)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="measure the batch-invariant mode (ServerArgs.enable_deterministic_inference)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: decode step time vs batch size per context length")
    return p


PROFILE_WARMUP = 8  # decode steps before the batch-1 split starts counting


def decode_repeats(args: argparse.Namespace) -> int:
    if not 0 <= args.decode_repeats <= 4096:
        raise ValueError(f"--decode-repeats: must be in [0, 4096] (0 = --repeats), got {args.decode_repeats}")
    return args.decode_repeats or args.repeats


def needed_tokens(args: argparse.Namespace) -> int:
    steps = decode_repeats(args) + args.warmup + 2  # decode steps appended per row, +1 for --profile
    if args.profile:
        steps = max(steps, args.profile_steps + PROFILE_WARMUP + 2)  # the batch-1 split's one request
    decode = max(args.batch_sizes) * (max(args.context_lens) + steps)
    return max(decode, max(args.prefill_lens)) + 64


def make_runner(args: argparse.Namespace) -> Any:

    extra = max(decode_repeats(args) + args.warmup, (args.profile_steps + PROFILE_WARMUP) if args.profile else 0) + 2
    longest = max(max(args.context_lens) + extra, max(args.prefill_lens))
    server_args = ServerArgs(
        model_path=args.model_path, max_total_tokens=args.max_total_tokens or needed_tokens(args),
        max_running_requests=max(args.batch_sizes) + 1, num_threads=args.threads, show_progress=False,
        enable_deterministic_inference=args.enable_deterministic_inference, quantization=args.quantization,
        disable_cpu_graph=args.disable_cpu_graph, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        quant_max_rows=args.quant_max_rows,
    )
    if longest > get_model_config(server_args.resolved_model_path()).context_len:
        server_args = server_args.replace(context_length=longest)
    return ModelRunner(server_args)


def _seconds(device: torch.device, fn: Any, *args: Any) -> float:
    """Wall time of one call (the device synchronised before the clock stops)."""
    t0 = time.perf_counter()
    fn(*args)
    synchronize(device)
    return time.perf_counter() - t0


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def bench_prefill(drv: RunnerDriver, lens: list[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    runner, out = drv.runner, []
    for n in lens:
        ids = drv.random_ids(n)
        times = []
        for i in range(warmup + repeats):
            row = drv.new_row()
            t = _seconds(runner.device, drv.prefill, row, ids)
            drv.release(row)
            if i >= warmup:
                times.append(t)
        ms = _median_ms(times)
        flops = model_cost.prefill_flops(runner.model_config, runner.model, n)
        out.append({"prompt_len": n, "ms": ms, "tokens_per_s": n / ms * 1e3, "ms_per_token": ms / n,
                    "gflops": flops / ms / 1e6})
    return out


def bench_decode(drv: RunnerDriver, ctx_lens: list[int], batch_sizes: list[int], repeats: int, warmup: int,
                 profile: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    runner = drv.runner
    rows_out, skipped, profiles = [], [], []
    steps = repeats + warmup + 1
    for ctx in ctx_lens:
        alloc = runner.token_to_kv_pool_allocator
        fit = alloc.full_available_size() // (ctx + steps)
        window = getattr(alloc, "swa_window", None)
        if window is not None:  # a hybrid pool: each row keeps its last window's local KV (RunnerDriver._trim)
            fit = min(fit, (alloc.swa_available_size() - ctx) // (min(ctx, window) + steps + 1))
        fit = min(fit, runner.req_to_token_pool.available_size())
        wanted = [bs for bs in batch_sizes if bs <= fit]
        skipped += [{"batch_size": bs, "context_len": ctx, "reason": "KV pool / request rows too small"}
                    for bs in batch_sizes if bs > fit]
        if not wanted:
            continue
        rows = drv.build_contexts(ctx, max(wanted))
        for bs in wanted:
            sel = rows[:bs]
            times = []
            for i in range(warmup + repeats):
                ids = drv.random_ids(bs)
                t = _seconds(runner.device, drv.decode, sel, ids)
                if i >= warmup:
                    times.append(t)
            if profile and ctx == ctx_lens[0] and bs in (min(wanted), max(wanted)):
                prof = profile_step(functools.partial(drv.decode, sel, drv.random_ids(bs)), warmup=0)
                profiles.append({"batch_size": bs, "context_len": ctx, **prof})
            for row in sel:
                drv.truncate(row, ctx)
            ms = _median_ms(times)
            rows_out.append({"batch_size": bs, "context_len": ctx, "decode_step_ms": ms,
                             "tokens_per_s": bs / ms * 1e3, "ms_per_token": ms / bs})
        for row in rows:
            drv.release(row)
    return rows_out, skipped, profiles


def derive(result: dict[str, Any], runner: Any) -> None:
    """The seed's comparisons: decode vs prefill per token, prefill vs roofline, decode vs bandwidth."""
    cfg, roof = runner.model_config, result["roofline"]
    decode, prefill = result["decode"], result["prefill"]
    for r in prefill:
        r["fraction_of_peak_flops"] = r["gflops"] / roof["peak_gflops"]
    by_ctx = {r["context_len"]: r for r in decode if r["batch_size"] == 1}
    linear = {r["rows"]: r for r in result["linear_only"]}
    for r in decode:
        base = next(d for d in decode if d["context_len"] == r["context_len"] and d["batch_size"] == min(
            x["batch_size"] for x in decode if x["context_len"] == r["context_len"]))
        r["step_vs_smallest_batch"] = r["decode_step_ms"] / base["decode_step_ms"]
        if r["batch_size"] in linear:
            r["linear_only_ms"] = linear[r["batch_size"]]["ms"]
            r["step_over_linear_only"] = r["decode_step_ms"] / r["linear_only_ms"]
    ratios = []
    for p in prefill:
        if not by_ctx:
            break
        ctx = min(by_ctx, key=lambda c: abs(c - p["prompt_len"]))
        d = by_ctx[ctx]
        ratios.append({"prompt_len": p["prompt_len"], "context_len": ctx, "prefill_ms_per_token": p["ms_per_token"],
                       "decode_ms_per_token": d["decode_step_ms"], "ratio": d["decode_step_ms"] / p["ms_per_token"]})
    result["decode_vs_prefill"] = ratios
    bw = []
    for ctx, d in sorted(by_ctx.items()):
        b = model_cost.decode_bytes(cfg, model_cost.streamed_weight_bytes(runner.model, runner.dtype, runner.quant_ops is not None), 1, ctx,
                                   runner.kv_cache_dtype)
        achieved = b["total_bytes"] / d["decode_step_ms"] / 1e6
        bw.append({"context_len": ctx, **b, "decode_step_ms": d["decode_step_ms"],
                   "bound_ms": b["total_bytes"] / roof["bandwidth_gb_per_s"] / 1e6,
                   "achieved_gb_per_s": achieved, "fraction_of_bandwidth": achieved / roof["bandwidth_gb_per_s"]})
    result["batch1_decode_bandwidth"] = bw


def run(runner: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Everything but the model load: the test suite calls this with its session ModelRunner."""
    drv = RunnerDriver(runner, seed=args.seed)
    result: dict[str, Any] = {"model": runner.model_path, "machine": machine_info(str(runner.device)),
                              "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    with torch.inference_mode():
        result["roofline"] = measure_roofline(runner.model_config, args.roofline_rows, args.roofline_mem_mb,
                                              str(runner.device), args.roofline_min_time)
    try:
        result["prefill"] = bench_prefill(drv, args.prefill_lens, args.repeats, args.warmup)
        result["decode"], result["skipped"], result["profiles"] = bench_decode(
            drv, args.context_lens, args.batch_sizes, decode_repeats(args), args.warmup, args.profile)
    finally:
        drv.release_all()
    if args.profile and runner.cpu_graph_runner is not None:
        result["step_split"] = [decode_profile.profile_batch1(runner, ctx, args.profile_steps, PROFILE_WARMUP,
                                                              seed=args.seed) for ctx in args.context_lens]
    measured = sorted({r["batch_size"] for r in result["decode"]})
    # the linears as this runner's forward runs them
    result["linear_only"] = [model_cost.time_linear_only(runner.model, bs, args.repeats, args.warmup,
                                                         runner.kernel_mode) for bs in measured]
    derive(result, runner)
    return result


def report(result: dict[str, Any]) -> None:
    roof = result["roofline"]
    print(f"model {result['model']}  |  roofline: peak {roof['peak_gflops']:.1f} GFLOP/s "
          f"({roof['peak_rows']} rows), bandwidth {roof['bandwidth_gb_per_s']:.1f} GB/s")
    print_table(result["prefill"], ["prompt_len", "ms", "ms_per_token", "tokens_per_s", "gflops",
                                    "fraction_of_peak_flops"], title="\nPREFILL (one request)")
    print_table(result["decode"], ["batch_size", "context_len", "decode_step_ms", "tokens_per_s",
                                   "step_vs_smallest_batch", "linear_only_ms", "step_over_linear_only"],
                title="\nDECODE (one step)")
    print_table(result["decode_vs_prefill"], title="\ndecode per-token time / prefill per-token time (batch 1)")
    print_table(result["batch1_decode_bandwidth"], ["context_len", "weight_bytes", "kv_bytes", "decode_step_ms",
                                                    "bound_ms", "achieved_gb_per_s", "fraction_of_bandwidth"],
                title="\nbatch-1 decode vs memory bandwidth (bytes read at least once per step)")
    for s in result.get("skipped", []):
        print(f"skipped batch {s['batch_size']} at context {s['context_len']}: {s['reason']}")
    for split in result.get("step_split", []):
        decode_profile.report(split)
    for prof in result.get("profiles", []):
        print_table(prof["top"], ["name", "calls", "self_ms", "pct"],
                    title=f"\nprofile: decode batch {prof['batch_size']} context {prof['context_len']}: wall "
                          f"{prof['wall_ms']:.2f} ms, torch ops {prof['ops_self_ms']:.2f} ms (self)")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx in sorted({r["context_len"] for r in result["decode"]}):
        pts = sorted((r["batch_size"], r["decode_step_ms"], r["tokens_per_s"])
                     for r in result["decode"] if r["context_len"] == ctx)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"context {ctx}")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"context {ctx}")
    sizes = sorted({r["batch_size"] for r in result["decode"]})
    for ax, ylabel in ((ax1, "decode step time (ms)"), (ax2, "decode throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_title("one decode step vs batch size")
    ax2.set_title("tokens/s vs batch size")
    fig.suptitle(f"{result['model'].split('/')[-1]} on {result['machine'].get('cpu', result['machine']['device'])}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None, runner: Any = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if not 1 <= args.profile_steps <= 4096:
        raise SystemExit("--profile-steps must be in 1..4096")
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = runner or make_runner(args)
    result = run(runner, args)
    report(result)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
