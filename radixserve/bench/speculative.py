"""bench speculative: speculative decoding against plain decoding, one request at a time.

Workloads through the real Scheduler (same weights, same settings but --speculative-algorithm):
  copy     prompts whose answer repeats part of the prompt (a list to repeat, code to extend, a sentence
           to quote): where prompt lookup pays off
  passage  a ~300-token passage to repeat word for word (the issue's repetitive workload)
  fresh    open-ended prompts: what speculation costs when there is little to look up
Each workload runs greedy and sampled (temperature > 0, a seed per request), with each algorithm: ngram,
and draft_model with --draft-model-path (default: the target itself, which is kept ~always but costs a
second model's forwards: a correctness and overhead measure, not a speed-up; give a smaller model of the
same tokenizer for that). Printed per row: decode tokens/s plain and speculative, their ratio, the mean
tokens per verify forward (accept length, bonus included), and whether outputs equal plain decoding's
(expected for greedy, and for seeded sampling with ngram's point-mass drafts; n/a for sampled drafts).

    radixserve bench speculative [--quantization none] [--max-new-tokens 64] [--workloads copy,passage]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixserve.bench.common import print_table, write_json
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

COPY = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango. "
    "Now the list again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n",
    "Quote this sentence word for word: The committee will meet on Tuesday at ten in the morning to review the "
    "budget for the next quarter. Quote: The committee will meet",
    "Names: Alice Smith, Bob Jones, Carol White, David Brown, Eve Black. Sorted the same way: Alice Smith, Bob",
]
_PASSAGE = (
    "The river starts high in the mountains, where snow melts in the spring and feeds a hundred small streams. "
    "They join in the valley and turn the old mill wheel, which has ground flour for the village for two "
    "hundred years. Below the mill the water slows and widens, and the fishermen wait on the wooden bridge "
    "for the evening rise. In summer children swim in the deep pool by the willow trees, and in autumn the "
    "leaves drift down and gather against the stones. The farmers use the water for their fields of wheat and "
    "barley, and the cattle drink at the shallow ford where the road crosses. Further on, the river passes "
    "the market town with its stone church and narrow streets, and boats carry timber and grain to the "
    "harbour. At last it reaches the sea, broad and brown, and the tide pushes back against it twice a day."
)
PASSAGE = [f"Repeat the following passage exactly, word for word.\n\n{_PASSAGE}\n\nThe passage again:\n"]
FRESH = ["Once upon a time", "Tell me about the ocean.", "What is the best way to learn to cook?",
         "Describe a city at night."]
WORKLOADS = {"copy": COPY, "passage": PASSAGE, "fresh": FRESH}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--min-match-window", type=int, default=None, help="default: ServerArgs' own")
    p.add_argument("--algorithms", default="ngram,draft_model", help="comma-separated: ngram, draft_model")
    p.add_argument("--draft-model-path", default=None, help="draft_model's draft (default: the target itself)")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated; > 0 samples with a seed per request")
    p.add_argument("--workloads", default="copy,passage,fresh", help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--num-prompts", type=int, default=None, help="at most this many prompts per workload")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def _decode_run(sched: Any, prompts: list[list[int]], max_new: int, temperature: float
                ) -> tuple[list[list[int]], float, int, float]:
    """(outputs, decode seconds, decode tokens, mean accept length) over prompts run one at a time."""

    outs, secs, toks, acc = [], 0.0, 0, []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=i if temperature > 0 else None)
        sched.add_request(TokenizedGenerateReqInput(f"b{i}", p, params, stream=True))
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


def main(argv: list[str] | None = None, runner: Any = None) -> dict[str, Any]:
    """`runner`: reuse an already-loaded ModelRunner's weights (tests); its settings are kept."""
    args = build_parser().parse_args(argv)
    if not 1 <= args.max_new_tokens <= 4096:
        raise SystemExit("--max-new-tokens must be in 1..4096")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    algorithms = [a for a in args.algorithms.split(",") if a]
    workloads = [w for w in args.workloads.split(",") if w]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    if not set(algorithms) <= {"ngram", "draft_model"} or not set(workloads) <= set(WORKLOADS) or not temperatures:
        raise SystemExit(f"--algorithms: ngram, draft_model; --workloads: {', '.join(WORKLOADS)}; --temperatures: >= 1")

    if runner is None:
        base = ServerArgs(model_path=args.model_path, quantization=args.quantization, max_total_tokens=8192,
                          max_running_requests=4, num_threads=args.threads, show_progress=False)
        runner = ModelRunner(base)
    base = runner.server_args.replace(speculative_num_draft_tokens=args.num_draft_tokens)
    if args.min_match_window is not None:
        base = base.replace(speculative_ngram_min_match_window=args.min_match_window)
    draft_path = args.draft_model_path or runner.model_path

    def scheduler(algo: str | None) -> Any:
        a = base.replace(speculative_algorithm=algo,
                         speculative_draft_model_path=draft_path if algo == "draft_model" else None)
        sched = Scheduler(a, model_runner=ModelRunner(a, model=runner.model))
        _decode_run(sched, [sched.tokenizer.encode("Hello", add_special_tokens=False)], 4, 0.0)  # warm-up
        return sched

    tok = Scheduler(base, model_runner=runner).tokenizer
    scheds = {algo: scheduler(algo) for algo in [None, *algorithms]}
    rows = []
    for name in workloads:
        prompts = [tok.encode(t, add_special_tokens=False) for t in WORKLOADS[name][: args.num_prompts]]
        for temp in temperatures:
            o0, s0, t0, _ = _decode_run(scheds[None], prompts, args.max_new_tokens, temp)
            for algo in algorithms:
                o1, s1, t1, acc = _decode_run(scheds[algo], prompts, args.max_new_tokens, temp)
                exact = temp == 0 or algo == "ngram"  # sampled drafts give other (equally distributed) tokens
                plain_tps, spec_tps = t0 / max(s0, 1e-9), t1 / max(s1, 1e-9)
                rows.append({"workload": name, "algorithm": algo, "temperature": temp,
                             "plain_tok_s": round(plain_tps, 1), "spec_tok_s": round(spec_tps, 1),
                             "speedup": round(spec_tps / max(plain_tps, 1e-9), 2), "mean_accept_length": round(acc, 2),
                             "identical_outputs": (o0 == o1) if exact else None})
    print(f"one request at a time, {args.max_new_tokens} new tokens, quantization {runner.quantization}, "
          f"<= {args.num_draft_tokens} drafts, draft model {draft_path}")
    print_table(rows)
    result = {"rows": rows, "draft_model_path": draft_path, "quantization": runner.quantization}
    if args.json:
        write_json(args.json, result)
    return result
