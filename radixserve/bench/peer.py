"""bench peer: radixserve against llama.cpp on the same GGUF, same threads, in one run, as ratios.

llama.cpp is measured by its own `llama-bench` (a binary given by path: build it with
../shared/peers/build_llamacpp.sh, or any llama.cpp build; it is never a runtime dependency) on the
figures it defines: pp512 (prefill of 512 tokens) and tg128 (128 generated tokens from an empty
context). radixserve is measured through the real ModelRunner (bench one-batch) on the same figures:
a 512-token PREFILL and batch-1 DECODE steps at context 128 (the far end of tg128's contexts, so the
comparison does not favour radixserve), once per requested format (--formats exact,auto,none,int8,int4:
exact = --dtype float32 --quantization none; none = float weights in the default dtype, bf16 on a CPU with
native bf16 matmul; the others are --quantization values with the default dtype). Both sides run one after the other with nothing else in between.
A last table has one row per tensor type the file holds: its kernel's time on the type's largest tensor.

    radixserve bench peer --llama-bench /tmp/peer/llama.cpp/build/bin/llama-bench --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from typing import Any

from radixserve.bench import llama_cpp_python, one_batch
from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.quantization import type_report
from radixserve.model_loader import default_model_path

# format -> (ServerArgs.quantization, ServerArgs.dtype)
FORMATS = {"exact": ("none", "float32"), "auto": ("auto", "auto"), "none": ("none", "auto"),
           "int8": ("int8", "auto"), "int4": ("int4", "auto")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench peer", description=__doc__.split("\n")[0])
    peer = p.add_mutually_exclusive_group(required=True)
    peer.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    peer.add_argument("--llama-cpp-python", metavar="PYTHON",
                      help="a Python interpreter with llama-cpp-python installed: a current llama.cpp through its "
                           "Llama API (Gemma 3, Qwen3; bench/llama_cpp_python.py)")
    p.add_argument("--long-contexts", default="", help="comma-separated contexts of extra batch-1 decode figures "
                                                       "(e.g. 8192: a sliding-window model's cost should stay flat)")
    p.add_argument("--model-path", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="exact,auto", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--context-len", type=int, default=128, help="context of radixserve's batch-1 decode steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="ServerArgs.kv_cache_dtype of radixserve's runs")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="ServerArgs.dtype of radixserve's runs other than exact (float32 on a bf16 CPU runs the "
                        "path a CPU without bf16 runs; with RADIXSERVE_CPU_ISA=avx2, an AVX2 machine's)")
    p.add_argument("--json", default=None)
    return p


def llama_bench(binary: str, gguf: str, threads: int, prompt_len: int, gen_len: int, repeats: int = 3
                ) -> dict[str, float]:
    """{"pp": tokens/s, "tg": tokens/s} from `llama-bench -o json`."""
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"--llama-bench {binary}: not an executable file")
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt_len), "-n", str(gen_len), "-r", str(repeats), "-o",
           "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = json.loads(proc.stdout)
    out: dict[str, float] = {}
    for r in rows:
        key = "pp" if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0 else "tg"
        out[key] = float(r["avg_ts"])
    out["build"] = rows[0].get("build_commit", "?") if rows else "?"  # type: ignore[assignment]
    return out


def one_batch_args(fmt: str, args: argparse.Namespace) -> argparse.Namespace:
    """bench one-batch's arguments for radixserve's run of format `fmt`."""
    ns = one_batch.build_parser().parse_args([])
    ns.model_path, ns.threads = args.model_path, args.threads
    ns.quantization, ns.dtype = FORMATS[fmt]
    if fmt != "exact":
        ns.dtype = args.dtype
    ns.kv_cache_dtype = args.kv_cache_dtype
    ns.prefill_lens, ns.batch_sizes = [args.prompt_len], [1]
    ns.context_lens = [args.context_len, *_contexts(args)]
    # the decode figure is a median of 64 steps (one step is a few ms: three swung 0.8-1.2x on a shared VM, where
    # llama-bench's tg128 averages 128 tokens a run)
    ns.repeats, ns.warmup, ns.decode_repeats = args.repeats, 2, max(64, args.repeats)
    ns.roofline_rows, ns.roofline_min_time = [1, 512], 0.1
    return ns


def radixserve_figures(fmt: str, args: argparse.Namespace) -> dict[str, float]:
    ns = one_batch_args(fmt, args)
    runner = one_batch.make_runner(ns)
    res = one_batch.run(runner, ns)
    pf = res["prefill"][0]
    dec = next(r for r in res["decode"] if r["batch_size"] == 1 and r["context_len"] == args.context_len)
    bw = res["batch1_decode_bandwidth"][0]
    out = {"pp": pf["tokens_per_s"], "tg": dec["tokens_per_s"], "prefill_fraction_of_peak_flops": pf["fraction_of_peak_flops"],
           "decode_fraction_of_bandwidth": bw["fraction_of_bandwidth"], "decode_step_ms": dec["decode_step_ms"]}
    for ctx in _contexts(args):
        out[f"tg_at_{ctx}"] = next(r["tokens_per_s"] for r in res["decode"]
                                   if r["batch_size"] == 1 and r["context_len"] == ctx)
    return out


def _contexts(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.long_contexts.split(",") if c.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; choose from {list(FORMATS)}")
    gguf = args.model_path or default_model_path()
    if args.llama_bench:
        peer = llama_bench(args.llama_bench, gguf, args.threads, args.prompt_len, args.gen_len)
        if _contexts(args):
            raise SystemExit("--long-contexts needs --llama-cpp-python (llama-bench has no context-depth figure here)")
    else:
        peer = llama_cpp_python.speed(args.llama_cpp_python, gguf, args.threads, args.prompt_len, args.gen_len,
                                      _contexts(args))
    ours = {fmt: radixserve_figures(fmt, args) for fmt in formats}
    rows = []
    figures = [("pp", f"prefill {args.prompt_len} (tok/s)"), ("tg", f"batch-1 decode (tok/s; llama.cpp tg{args.gen_len})")]
    figures += [(f"tg_at_{c}", f"batch-1 decode at context {c} (tok/s)") for c in _contexts(args)]
    for key, label in figures:
        row: dict[str, Any] = {"figure": label, "llama.cpp": round(peer[key], 1)}
        for fmt in formats:
            row[f"radixserve {fmt}"] = round(ours[fmt][key], 1)
            row[f"{fmt} / llama.cpp"] = round(ours[fmt][key] / peer[key], 2)
        rows.append(row)
    print(f"model {gguf}  |  threads {args.threads}  |  llama.cpp build {peer['build']}  |  {machine_info('cpu')}")
    print_table(rows)
    print_table([{"format": fmt, "prefill: fraction of peak FLOP/s": round(ours[fmt]["prefill_fraction_of_peak_flops"], 2),
                  "batch-1 decode: fraction of bandwidth": round(ours[fmt]["decode_fraction_of_bandwidth"], 2),
                  "decode step ms": round(ours[fmt]["decode_step_ms"], 2)} for fmt in formats],
                title="\nradixserve against this machine's roofline (bench roofline, measured in each run)")

    types = type_report.type_rows(gguf, load_cpu_ops()[0], rows=(1, args.prompt_len))
    print_table(types, type_report.columns(types),
                title="\nper tensor type of the file: its kernel on the type's largest tensor (float path: torch)")
    result = {"model": gguf, "threads": args.threads, "llama_cpp": peer, "radixserve": ours, "table": rows,
              "tensor_types": types}
    if args.json:
        write_json(args.json, result)
    return result
