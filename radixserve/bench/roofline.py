"""bench roofline: this machine's own limits, measured — the ceilings every other number is read against.

The seed's argument is a roofline argument: prefill is one big GEMM (S rows x hidden x ...), so it
runs near the machine's peak FLOP/s; a decode step is the same weights multiplied by one row, so
it does ~S times fewer FLOPs per byte of weight read and is bounded by memory bandwidth instead.
This benchmark measures both ceilings here, with the loaded model's own matrix shapes:

  * float32 matmul FLOP/s at prefill-like shapes ([512, hidden] x [hidden, intermediate], ...) and
    decode-like shapes (1 row and 32 rows against the same weights; the LM head only at these,
    as it sees one row per request even in prefill), plus the arithmetic
    intensity (FLOPs per byte moved) of each, so one can see which side of the ridge it sits on;
  * memory bandwidth: a large copy (read + write) and a large reduction (read only).

Weights are cycled through --mem-mb of distinct copies, so that no matmul reads a weight
from cache (a decode step reads ~0.5 GB of weights once each; nothing stays cached).

`measure_roofline()` is what `bench one-batch` calls; `main()` prints a table and writes JSON.

    radixserve bench roofline [--model-path PATH] [--rows 1,32,512] [--mem-mb 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from radixserve.bench.common import (
    machine_info,
    parse_int_list,
    print_table,
    time_fn_min_duration,
    write_json,
)
from radixserve.model_loader import default_model_path, get_model_config

DEFAULT_ROWS = [1, 32, 512]
LM_HEAD_MAX_ROWS = 64  # the LM head sees one row per request, i.e. decode-like shapes only


def linear_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linear layers and the LM head."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "qkv_proj": (cfg.hidden_size, q + 2 * kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
        "lm_head": (cfg.hidden_size, cfg.vocab_size),
    }


def measure_matmul(rows: int, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", min_s: float = 0.2, cold_mb: float = 0.0) -> dict[str, Any]:
    """FLOP/s of x[rows, in] @ W[out, in]^T (F.linear, the layout the model uses).

    cold_mb > 0: cycle through enough distinct copies of W to fill that many MB, so each call
    reads a W that is not in the CPU caches — as in a decode step, which walks every layer's
    weights once. Otherwise a small W timed in a loop stays cache-resident and a 1-row GEMM
    looks several times faster than any real decode can be."""
    w_bytes = in_features * out_features * torch.finfo(dtype).bits // 8
    copies = max(1, min(512, math.ceil(cold_mb * 2**20 / w_bytes))) if cold_mb > 0 else 1
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    ws = torch.ones(copies, out_features, in_features, dtype=dtype, device=device)
    out = torch.empty(rows, out_features, dtype=dtype, device=device)
    turn = [0]

    def run() -> None:
        torch.matmul(x, ws[turn[0]].t(), out=out)
        turn[0] = (turn[0] + 1) % copies
        if device != "cpu":
            torch.cuda.synchronize(device)

    seconds = time_fn_min_duration(run, min_s)
    flops = 2.0 * rows * in_features * out_features
    nbytes = (x.numel() + out.numel()) * x.element_size() + w_bytes
    return {
        "rows": rows, "in": in_features, "out": out_features, "ms": seconds * 1e3,
        "gflops": flops / seconds / 1e9, "gb_per_s": nbytes / seconds / 1e9,
        "flops_per_byte": flops / nbytes, "weight_copies": copies,
    }


def measure_bandwidth(mem_mb: int = 256, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      min_s: float = 0.3) -> dict[str, float]:
    """GB/s of a large copy (bytes read + written) and a large sum (bytes read).

    The buffers are several times any last-level cache, so this is DRAM (or HBM) bandwidth."""
    n = mem_mb * 2**20 // torch.finfo(dtype).bits * 8
    src = torch.ones(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    t_copy = time_fn_min_duration(lambda: (dst.copy_(src), sync()), min_s, max_iters=200)
    t_sum = time_fn_min_duration(lambda: (src.sum(), sync()), min_s, max_iters=200)
    return {
        "buffer_mb": float(mem_mb),
        "copy_gb_per_s": 2 * nbytes / t_copy / 1e9,
        "reduce_gb_per_s": nbytes / t_sum / 1e9,
    }


def measure_roofline(cfg: Any | None = None, rows_list: list[int] | None = None, mem_mb: int = 256,
                     device: str = "cpu", min_s: float = 0.2) -> dict[str, Any]:
    """Matmul FLOP/s for the model's linear shapes at each row count, and memory bandwidth.

    Returns {"matmul": [...], "bandwidth": {...}, "peak_gflops", "decode_gflops_1row",
    "bandwidth_gb_per_s", "ridge_flops_per_byte", "machine"}. `bandwidth_gb_per_s` is the larger
    of copy and reduce: the best this machine showed for streaming memory.
    """
    if cfg is None:
        cfg = get_model_config(default_model_path())
    rows_list = rows_list or DEFAULT_ROWS
    matmul = []
    for name, (fin, fout) in linear_shapes(cfg).items():
        for rows in rows_list:
            if name == "lm_head" and rows > LM_HEAD_MAX_ROWS:
                continue  # prefill computes logits for one row per request: never a tall LM-head GEMM
            matmul.append({"layer": name, **measure_matmul(rows, fin, fout, device=device, min_s=min_s,
                                                           cold_mb=mem_mb)})
    bandwidth = measure_bandwidth(mem_mb, device=device, min_s=min_s)
    bw = max(bandwidth["copy_gb_per_s"], bandwidth["reduce_gb_per_s"])
    big = max(rows_list)
    peak = max(m["gflops"] for m in matmul if m["rows"] == big)
    one_row = [m["gflops"] for m in matmul if m["rows"] == 1]
    return {
        "machine": machine_info(device),
        "matmul": matmul,
        "bandwidth": bandwidth,
        "peak_gflops": peak,
        "peak_rows": big,
        "decode_gflops_1row": max(one_row) if one_row else None,
        "bandwidth_gb_per_s": bw,
        # FLOPs per byte at which compute and memory take equal time: below it, memory-bound.
        "ridge_flops_per_byte": peak * 1e9 / (bw * 1e9),
    }


def print_roofline(result: dict[str, Any]) -> None:
    print_table(result["matmul"], ["layer", "rows", "in", "out", "ms", "gflops", "gb_per_s", "flops_per_byte"],
                title="float32 matmul x[rows, in] @ W[in, out]")
    bw = result["bandwidth"]
    print_table(
        [{"copy_gb_per_s": bw["copy_gb_per_s"], "reduce_gb_per_s": bw["reduce_gb_per_s"],
          f"peak_gflops@{result['peak_rows']}rows": result["peak_gflops"],
          "ridge_flops_per_byte": result["ridge_flops_per_byte"]}],
        title=f"\nmemory bandwidth ({bw['buffer_mb']:.0f} MB buffers) and the ridge point",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench roofline", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="model whose linear shapes to time (default: embedded)")
    p.add_argument("--rows", type=parse_int_list, default=DEFAULT_ROWS, help="row counts (tokens per matmul)")
    p.add_argument("--mem-mb", type=int, default=256,
                   help="buffer size of the bandwidth test, and MB of weight copies each matmul cycles through")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds each measurement repeats for")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_model_config(args.model_path or default_model_path())
    with torch.inference_mode():
        result = measure_roofline(cfg, args.rows, args.mem_mb, args.device, args.min_time)
    print_roofline(result)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
