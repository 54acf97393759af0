"""bench grammar: what constrained decoding costs.

  compile   the 20 schemas of bench/grammar_schemas.py compiled against the model's vocabulary: cold
            (first time) and cached (the LRU of XGrammarBackend), milliseconds per schema
  masking   per decode step at batch B (default 32): filling the batch bitmask from B live matchers
            (each walking a random valid path through its schema, so states include mid-string and
            mid-number ones) and applying it to [B, vocab] logits, next to the time of a real batch-B
            decode step of the model without constraints

    radixserve bench grammar [--batch-size 32] [--steps 48] [--quantization auto]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from radixserve.bench.common import print_table, write_json
from radixserve.bench.grammar_schemas import SCHEMAS
from radixserve.constrained.grammar_spec import GrammarSpec
from radixserve.constrained.xgrammar_backend import apply_vocab_mask_, fill_vocab_mask
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench grammar", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed for masking")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} (min {min(xs) * 1e3:.2f}, max {max(xs) * 1e3:.2f})"


def _compile_rows(backend: Any) -> tuple[list[dict[str, Any]], dict[str, float]]:
    rows, cold, warm = [], [], []
    for i, schema in enumerate(SCHEMAS):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        backend.compile_async(spec).result()
        t1 = time.perf_counter()
        backend.compile_async(spec).result()
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
        rows.append({"schema": i, "cold_ms": round((t1 - t0) * 1e3, 2), "cached_ms": round((t2 - t1) * 1e3, 4)})
    return rows, {"cold_total_ms": sum(cold) * 1e3, "cold_median_ms": statistics.median(cold) * 1e3,
                  "cached_median_ms": statistics.median(warm) * 1e3}


def _masking(backend: Any, bs: int, steps: int, seed: int = 0) -> dict[str, list[float]]:
    """Fill + apply times per step for bs matchers walking random valid paths."""

    rng = random.Random(seed)
    compiled = [backend.compile_async(GrammarSpec("json_schema", json.dumps(s))).result() for s in SCHEMAS]
    grammars = [backend.new_grammar(compiled[i % len(compiled)]) for i in range(bs)]
    vocab = backend.vocab_size
    logits = torch.randn(bs, vocab)
    bits = torch.arange(32, dtype=torch.int32)
    fill, apply = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = fill_vocab_mask(grammars)
        t1 = time.perf_counter()
        x = logits.clone()
        t2 = time.perf_counter()
        apply_vocab_mask_(x, mask)
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t3 - t2)
        allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().view(bs, -1)[:, :vocab]
        for i, g in enumerate(grammars):
            ids = torch.nonzero(allowed[i]).flatten().tolist()
            g.accept(ids[rng.randrange(len(ids))])
            if g.is_terminated():  # a finished request leaves; a new one takes its row
                grammars[i] = backend.new_grammar(compiled[rng.randrange(len(compiled))])
    return {"fill": fill, "apply": apply}


def _decode_step_s(args: argparse.Namespace, bs: int) -> tuple[float, Any]:
    """Median wall time of a real batch-bs decode step (Scheduler.step, no constraints)."""

    sargs = ServerArgs(model_path=args.model_path, quantization=args.quantization, max_total_tokens=16384,
                       max_running_requests=bs, num_threads=args.threads, show_progress=False)
    sched = Scheduler(sargs)
    p = SamplingParams(temperature=0.0, max_new_tokens=args.steps + 8, ignore_eos=True)
    for i in range(bs):
        sched.add_request(TokenizedGenerateReqInput(f"d{i}", sched.tokenizer.encode(f"Story {i}: once upon a time"), p))
    times = []
    while sched.has_work():
        full = len(sched.running_batch.reqs) == bs and not sched.waiting_queue
        t0 = time.perf_counter()
        sched.step()
        if full:
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] or times), sched


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if not 1 <= args.batch_size <= 256 or not 1 <= args.steps <= 10_000:
        raise SystemExit("--batch-size must be in 1..256 and --steps in 1..10000")
    if args.threads:
        torch.set_num_threads(args.threads)
    step_s, sched = _decode_step_s(args, args.batch_size)
    t0 = time.perf_counter()
    backend = sched.grammar_queue.backend  # the vocabulary scan (once per server)
    setup_ms = (time.perf_counter() - t0) * 1e3
    rows, summary = _compile_rows(backend)
    print(f"grammar compile, {len(SCHEMAS)} JSON schemas (backend set-up {setup_ms:.0f} ms, once per server)")
    print_table(rows)
    print(f"cold: total {summary['cold_total_ms']:.1f} ms, median {summary['cold_median_ms']:.2f} ms; "
          f"cached: median {summary['cached_median_ms']:.4f} ms")
    m = _masking(backend, args.batch_size, args.steps)
    fill, apply = statistics.median(m["fill"]), statistics.median(m["apply"])
    mask_rows = [{"batch": args.batch_size, "fill_ms": _ms(m["fill"]), "apply_ms": _ms(m["apply"]),
                  "decode_step_ms": round(step_s * 1e3, 2),
                  "mask_share_of_step": f"{(fill + apply) / step_s:.1%}"}]
    print(f"\nmasking per decode step, every row constrained (quantization {args.quantization}, medians)")
    print_table(mask_rows)
    result = {"compile": rows, "compile_summary": summary, "backend_setup_ms": setup_ms, "masking": mask_rows}
    write_json(args.json, result)
    return result
