"""bench collectives: what tensor / pipeline parallel pay in communication per step, on this machine.

Real torch.distributed (gloo on CPU) between `--world-size` processes, one thread each, timing the ops a
step of the model issues, at the row counts a step has (`--tokens`: 1..bs for decode, the chunk for prefill):

    all_reduce [n, hidden]            tensor parallel: 2 per layer (o_proj, down_proj) + 1 (embedding)
    all_gather [n, vocab / world]     tensor parallel: the logits, once per step
    send/recv  [2 n hidden + 1]       pipeline parallel: hidden + residual + status, once per stage boundary
    broadcast_object (n tokens)       pipeline parallel: the last stage's sampled tokens, to every rank
    broadcast_object (messages)       every rank, every loop iteration: rank 0's requests and clock

and the per-step totals for a model of `--layers` layers (default: SmolLM2-135M's 30 x 576, vocab 49152).

    radixserve bench collectives --world-size 2 --tokens 1,8,64,256 [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from radixserve.bench.common import parse_int_list, print_table, write_json
from radixserve.entrypoints.launcher import _free_port


def _median_s(fn: Any, iters: int) -> float:
    import torch.distributed as dist

    fn()
    dist.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(n: int, rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    """Median time of each op at `n` rows (rank 0's view; every rank runs the same ops)."""
    import torch
    import torch.distributed as dist

    x = torch.randn(n, args.hidden)
    shard = torch.randn(n, -(-args.vocab // world))
    parts = [torch.empty_like(shard) for _ in range(world)]
    buf = torch.randn(2 * n * args.hidden + 1)

    def pingpong() -> None:  # rank 0 -> 1 -> 0: two boundary messages
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    def bcast(obj: Any, src: int) -> Any:
        return lambda: dist.broadcast_object_list([obj if rank == src else None], src=src)

    return {
        "tokens": n,
        "all_reduce_us": _median_s(lambda: dist.all_reduce(x), args.iters) * 1e6,
        "all_gather_logits_us": _median_s(lambda: dist.all_gather(parts, shard), args.iters) * 1e6,
        "send_recv_us": _median_s(pingpong, args.iters) / 2 * 1e6,
        "bcast_tokens_us": _median_s(bcast(list(range(n)), world - 1), args.iters) * 1e6,
        "bcast_messages_us": _median_s(bcast(([], time.perf_counter()), 0), args.iters) * 1e6,
    }


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    rows = [_measure(n, rank, world, args) for n in args.tokens]
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench collectives", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="processes (2..16)")
    p.add_argument("--tokens", type=parse_int_list, default=[1, 8, 64, 256], help="rows per step, comma-separated")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    import multiprocessing as mp

    args = build_parser().parse_args(argv)
    if not 2 <= args.world_size <= 16:
        raise SystemExit("--world-size must be in [2, 16]")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, port, args, out)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for row in rows:
        # per step of the whole model: TP issues 2 all-reduces per layer + 1 (embedding) + the logits gather
        row["tp_step_ms"] = ((2 * args.layers + 1) * row["all_reduce_us"] + row["all_gather_logits_us"]) / 1e3
        # PP (world stages): one boundary message per stage boundary + the tokens' broadcast
        row["pp_step_ms"] = ((args.world_size - 1) * row["send_recv_us"] + row["bcast_tokens_us"]) / 1e3
    print_table([{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                title=f"gloo on {os.cpu_count()} CPUs, world {args.world_size}, hidden {args.hidden}, "
                      f"{args.layers} layers, vocab {args.vocab} (median of {args.iters})")
    write_json(args.json, {"world_size": args.world_size, "rows": rows})
