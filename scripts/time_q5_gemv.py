"""One-row GEMV of a 2048 x 2048 projection stored as Q5_0 blocks, through the packed 5-bit kind (Q5),
the 8-bit kind it used to take (Q8_0 of q - 16), and Q4_1 (the lossy re-quantisation used before):
kernel time (minimum over repeats: the box is shared and noisy) and bytes streamed per call.

    PYTHONPATH=. python scripts/time_q5_gemv.py [--n 2048 --k 2048] [--repeats 200] [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from radixserve.kernels.cpu import load_cpu_ops, loaded_isa
from radixserve.layers.quantization.gguf_formats import FORMATS, _q5_0
from radixserve.layers.quantization.qweight import QKIND_Q4_1, QKIND_Q8_0, QuantRows, QuantWeight


def q5_0_as_q8_0(raw: np.ndarray, n: int) -> QuantWeight:
    """The old exact mapping: q - 16 in int8, d per 32, no min."""
    q, d, _ = _q5_0(raw.reshape(-1, FORMATS["Q5_0"].block_bytes))
    rows = QuantRows(QKIND_Q8_0, torch.from_numpy((q.astype(np.int16) - 16).astype(np.int8).reshape(n, -1)),
                     torch.from_numpy(d.reshape(n, -1)))
    return QuantWeight.from_rows(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=200, help="calls per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops, why = load_cpu_ops()
    assert ops is not None, why
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k) * 0.05
    import gguf

    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q5_0)
    file_bytes = raw.nbytes
    weights = {
        "Q5_0 -> Q5": QuantWeight.from_rows(FORMATS["Q5_0"].rows(raw)),
        "Q5_0 -> Q8_0": q5_0_as_q8_0(raw, args.n),
        "requant Q4_1": QuantWeight.quantize(torch.from_numpy(FORMATS["Q5_0"].dequantize(raw).reshape(args.n, -1)),
                                             QKIND_Q4_1),
    }
    ref = weights["Q5_0 -> Q5"].dequantize()
    assert torch.equal(weights["Q5_0 -> Q8_0"].dequantize(), ref)
    x = torch.randn(1, args.k)
    print(f"ISA {loaded_isa()}, threads {torch.get_num_threads()}, {args.n} x {args.k}, one row; "
          f"file Q5_0 {file_bytes / 2**20:.2f} MiB ({8 * file_bytes / (args.n * args.k):.2f} bits/weight)")
    outs = {name: torch.empty(1, args.n) for name in weights}
    for name, qw in weights.items():
        for _ in range(20):  # warm-up
            ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, outs[name])
    # the kinds take turns within each round, so a burst of load from other processes hits them alike
    best = {name: float("inf") for name in weights}
    for _ in range(args.rounds):
        for name, qw in weights.items():
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, outs[name])
            best[name] = min(best[name], (time.perf_counter() - t0) / args.repeats)
    for name, qw in weights.items():
        nb = qw.nbytes()
        print(f"  {name:14s} {best[name] * 1e6:8.1f} us  {nb / 2**20:6.2f} MiB  {8 * nb / (args.n * args.k):.2f} "
              f"bits/weight  {nb / best[name] / 1e9:6.1f} GB/s")
    print("  Q5 == Q8_0 bits:", torch.equal(outs["Q5_0 -> Q5"], outs["Q5_0 -> Q8_0"]),
          "(not required: Q8_0 has no min term, a different float order)")


if __name__ == "__main__":
    main()
