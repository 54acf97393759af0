"""bench speculative: n-gram speculation against plain decoding, one request at a time, greedy.

Two workloads through the real Scheduler (same weights, same settings but --speculative-algorithm):
  copy   prompts whose answer repeats part of the prompt (a list to repeat, code to extend, a passage
         to quote): where prompt lookup pays off
  fresh  open-ended prompts: what speculation costs when there is little to look up
It prints decode tokens/s per workload with and without speculation, the ratio, and the mean
tokens per verify forward; outputs are checked to be identical (greedy speculation is exact).

    radixserve bench speculative [--quantization none] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixserve.bench.common import print_table, write_json

COPY = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango. "
    "Now the list again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n",
    "Quote this sentence word for word: The committee will meet on Tuesday at ten in the morning to review the "
    "budget for the next quarter. Quote: The committee will meet",
    "Names: Alice Smith, Bob Jones, Carol White, David Brown, Eve Black. Sorted the same way: Alice Smith, Bob",
]
FRESH = ["Once upon a time", "Tell me about the ocean.", "What is the best way to learn to cook?",
         "Describe a city at night."]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--min-match-window", type=int, default=None, help="default: ServerArgs' own")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def _decode_run(sched: Any, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float, int, float]:
    """(outputs, decode seconds, decode tokens, mean accept length) over prompts run one at a time."""
    from radixserve.managers.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling.sampling_params import SamplingParams

    outs, secs, toks, acc = [], 0.0, 0, []
    for i, p in enumerate(prompts):
        sched.add_request(TokenizedGenerateReqInput(f"b{i}", p, SamplingParams(temperature=0.0, max_new_tokens=max_new),
                                                    stream=True))
        ids: list[int] = []
        t_first = None
        while sched.has_work():
            for o in sched.step():
                ids.extend(o.new_token_ids)
                if t_first is None and ids:
                    t_first = time.perf_counter()  # after the prefill: time decode only
                if o.finished_reason is not None and o.meta_info.get("spec_verify_ct"):
                    acc.append(o.meta_info["spec_accept_length"])
        secs += time.perf_counter() - (t_first or time.perf_counter())
        toks += max(0, len(ids) - 1)
        outs.append(ids)
    return outs, secs, toks, (sum(acc) / len(acc) if acc else 0.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if not 1 <= args.max_new_tokens <= 4096:
        raise SystemExit("--max-new-tokens must be in 1..4096")
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    base = ServerArgs(model_path=args.model_path, quantization=args.quantization, max_total_tokens=8192,
                      max_running_requests=4, num_threads=args.threads, show_progress=False,
                      speculative_num_draft_tokens=args.num_draft_tokens)
    if args.min_match_window is not None:
        base = base.replace(speculative_ngram_min_match_window=args.min_match_window)
    runner = ModelRunner(base)
    tok = Scheduler(base, model_runner=runner).tokenizer
    rows = []
    for name, texts in (("copy", COPY), ("fresh", FRESH)):
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        res = {}
        for spec in (None, "ngram"):
            args_ = base.replace(speculative_algorithm=spec)
            sched = Scheduler(args_, model_runner=ModelRunner(args_, model=runner.model))
            _decode_run(sched, prompts[:1], 4)  # warm-up
            res[spec] = _decode_run(sched, prompts, args.max_new_tokens)
        (o0, s0, t0, _), (o1, s1, t1, acc) = res[None], res["ngram"]
        rows.append({"workload": name, "plain_tok_s": round(t0 / s0, 1), "ngram_tok_s": round(t1 / s1, 1),
                     "speedup": round((t1 / s1) / (t0 / s0), 2), "mean_accept_length": round(acc, 2),
                     "identical_outputs": o0 == o1})
    print(f"one request at a time, greedy, {args.max_new_tokens} new tokens, quantization {args.quantization}, "
          f"<= {args.num_draft_tokens} drafts")
    print_table(rows)
    result = {"rows": rows}
    if args.json:
        write_json(args.json, result)
    return result
