"""bench baseline: the same workload through Hugging Face transformers' `generate`, side by side.

What a serving engine buys, measured in one run on identical token ids (greedy, exactly the
requested number of output tokens each):

  hf-one-at-a-time  one request per `generate` call: every decode step multiplies the weights by
                    one row — the memory-bound tiny GEMM of the seed, with nothing to share it;
  hf-static-batch   left-padded batches of --batch-size: decode rows share each weight read, but
                    the batch runs until its longest request ends (padding and finished rows are
                    still computed) and a new batch waits for the whole previous one;
  radixserve        (--compare-radixserve) the offline Engine on the same prompts: continuous
                    batching admits requests as others finish, and the radix cache skips shared
                    prefixes.

Output tokens/s counts only the tokens each request asked for, so the static batch's wasted rows
show up as lower throughput; `generated_tokens` shows what it really computed.

    radixserve bench baseline --dataset random --num-requests 32 --batch-size 16 --compare-radixserve
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from radixserve.bench.common import print_table, write_json
from radixserve.bench.datasets import (
    Conversation,
    add_dataset_args,
    build_workload,
    load_tokenizer,
    workload_summary,
)
from radixserve.bench.offline import run_engine, run_waves, throughput_metrics
from radixserve.entrypoints.engine import Engine
from radixserve.model_loader import default_model_path

Generate = Callable[[list[list[int]], list[dict[str, Any]]], list[dict[str, Any]]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench baseline", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--batch-size", type=int, default=16, help="static batch size (left padding)")
    p.add_argument("--modes", default="one,static", help="comma list of: one, static")
    p.add_argument("--compare-radixserve", action="store_true", help="also run the offline Engine on the same ids")
    p.add_argument("--max-total-tokens", type=int, default=None, help="radixserve's KV pool (with --compare)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads for transformers")
    p.add_argument("--json", default=None)
    add_dataset_args(p)
    return p


def load_hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if os.path.isfile(path):  # GGUF: transformers dequantises it to float32 itself
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _gen_kwargs(n: int, pad_id: int) -> dict[str, Any]:
    # min_new_tokens suppresses EOS, so every row generates exactly n tokens
    return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "pad_token_id": pad_id,
            "temperature": None, "top_p": None, "top_k": None}


def hf_one_at_a_time(model: Any, pad_id: int, bar: tqdm) -> Generate:
    @torch.inference_mode()
    def generate(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        outs = []
        for ids, p in zip(prompts, params):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), **_gen_kwargs(p["max_new_tokens"], pad_id))
            outs.append({"output_ids": y[0, len(ids):].tolist(), "generated": y.shape[1] - len(ids)})
            bar.update(1)
        return outs

    return generate


def hf_static_batches(model: Any, pad_id: int, batch_size: int, bar: tqdm) -> Generate:
    @torch.inference_mode()
    def generate(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        outs = []
        for s in range(0, len(prompts), batch_size):
            chunk, lens = prompts[s : s + batch_size], [p["max_new_tokens"] for p in params[s : s + batch_size]]
            width = max(len(ids) for ids in chunk)
            x = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
            # a static batch runs until its longest request is done
            y = model.generate(x, attention_mask=mask, **_gen_kwargs(max(lens), pad_id))
            for row, n in zip(y, lens):
                outs.append({"output_ids": row[width : width + n].tolist(), "generated": y.shape[1] - width})
            bar.update(len(chunk))
        return outs

    return generate


def run_hf(generate_factory: Callable[[tqdm], Generate], convs: list[Conversation], name: str,
           warm_id: int) -> dict[str, Any]:
    generated = 0
    with tqdm(total=sum(c.num_requests for c in convs), desc=name, unit="req") as bar:
        inner = generate_factory(bar)

        def generate(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
            nonlocal generated
            outs = inner(prompts, params)
            generated += sum(o["generated"] for o in outs)
            return outs

        # warm-up (untimed): one tiny generate call
        inner([[warm_id] * 4], [{"max_new_tokens": 2}])
        bar.reset()
        t0 = time.perf_counter()
        records = run_waves(generate, convs)
        duration = time.perf_counter() - t0
    metrics = throughput_metrics(records, duration)
    metrics["generated_tokens"] = generated
    return {"engine": name, **metrics}


def run(args: argparse.Namespace, model: Any, tokenizer: Any, engine: Any = None) -> dict[str, Any]:
    convs = build_workload(args, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "one" in modes:
        rows.append(run_hf(lambda bar: hf_one_at_a_time(model, pad_id, bar), convs, "hf-one-at-a-time", pad_id))
    if "static" in modes:
        rows.append(run_hf(lambda bar: hf_static_batches(model, pad_id, args.batch_size, bar), convs,
                           f"hf-static-batch-{args.batch_size}", pad_id))
    if args.compare_radixserve:
        rows.append({"engine": "radixserve", **compare_radixserve(args, convs, engine)})
    best_hf = {r["engine"]: r["output_throughput"] for r in rows if r["engine"].startswith("hf")}
    for r in rows:
        for name, tput in best_hf.items():
            r[f"speedup_vs_{name}"] = r["output_throughput"] / tput
    return {"benchmark": "baseline", "workload": workload_summary(convs), "results": rows}


def compare_radixserve(args: argparse.Namespace, convs: list[Conversation], engine: Any) -> dict[str, Any]:
    own = engine is None
    if own:
        # same torch thread count as transformers got, so the comparison is like for like
        engine = Engine(model_path=args.model_path, max_total_tokens=args.max_total_tokens, show_progress=False,
                        num_threads=args.threads)
    try:
        return run_engine(engine, convs)["metrics"]
    finally:
        if own:
            engine.shutdown()


def main(argv: list[str] | None = None, model: Any = None, tokenizer: Any = None, engine: Any = None) -> dict:
    """`model` / `tokenizer` / `engine`: already loaded objects to reuse (tests)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model_path or default_model_path()
    tokenizer = tokenizer or load_tokenizer(args.tokenizer or path)
    model = model if model is not None else load_hf_model(path)
    out = run(args, model, tokenizer, engine)
    out["model"] = path
    cols = ["engine", "requests", "duration_s", "total_input_tokens", "total_output_tokens", "generated_tokens",
            "output_throughput", "total_throughput"]
    cols += [k for k in out["results"][0] if k.startswith("speedup_vs_")]
    print_table(out["results"], cols, title=f"baseline: {args.dataset} ({os.path.basename(path)}), output tokens/s")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
