"""bench accuracy: how far a fast format drifts from the exact mode, on real prompts.

The exact mode (--quantization none, float32: bit-compatible with the transformers oracle) generates
`--max-new-tokens` greedy tokens for each of `--num-prompts` chat prompts. Each other format then
reads the same tokens teacher-forced, one batch-1 DECODE step per token (the path the fast formats
speed up), and at every position we compare:

  top-1 agreement   the format's argmax equals the exact mode's token
  |Δ logprob|       |logprob_format(t) - logprob_exact(t)| of the exact mode's chosen token t
  first-position top-5 |Δ logprob|: the drift llama.cpp quotes for its own quantised formats

With --llama-server PATH, llama.cpp reads the same file and the same tokens in the same run (its
server's /completion with n_probs: the raw softmax, before sampling), so its own drift from the
exact mode is the row next to ours. A second table has one row per tensor type the file holds: what
`auto` does with it (exact kernel kind, float path, or re-quantised) and max |w_kernel - w_file|.

    radixserve bench accuracy --formats auto,int8,int4 [--llama-server PATH/llama-server]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from radixserve.bench import llama_cpp_python
from radixserve.bench.common import print_table, write_json
from radixserve.bench.runner_driver import RunnerDriver
from radixserve.bench.server_process import check_binary, local_llama_server
from radixserve.layers.quantization import type_report
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import get_tokenizer
from radixserve.server_args import ServerArgs

FORMATS = {"auto": "auto", "int8": "int8", "int4": "int4"}

PROMPTS = [
    "What is a radix tree?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers and explain why they are prime.", "What is the capital of Japan?",
    "Give me a recipe for pancakes.", "How does a bicycle stay upright?", "Translate 'good morning' into French.",
    "Why is the sky blue?", "Write a short story about a robot learning to paint.",
    "What are the benefits of exercise?", "Describe the water cycle.", "What is 17 times 23?",
    "Name the planets of the solar system.", "How do vaccines work?", "Summarise the plot of Romeo and Juliet.",
    "What is machine learning?", "Give three tips for writing clean code.", "What causes earthquakes?",
    "Write a limerick about a cat.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--formats", default="auto,int8,int4", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: its drift, same run")
    p.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                   help="a Python with llama-cpp-python: a current llama.cpp's drift, same run (Gemma 3, Qwen3)")
    p.add_argument("--json", default=None)
    return p


def _runner(model_path: str | None, quantization: str, threads: int | None, dtype: str = "auto",
            kv_cache_dtype: str = "auto", max_total_tokens: int = 4096) -> Any:
    """A runner for teacher-forced traces (one row at a time); bench kv-accuracy varies its KV dtype."""
    return ModelRunner(ServerArgs(model_path=model_path, quantization=quantization, dtype=dtype,
                                  kv_cache_dtype=kv_cache_dtype, max_total_tokens=max_total_tokens,
                                  max_running_requests=2, num_threads=threads, show_progress=False))


def _trace(runner: Any, prompt: list[int], forced: list[int] | None, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy (forced=None) or teacher-forced tokens and the log-softmax before each one."""
    drv = RunnerDriver(runner)
    row = drv.new_row()
    try:
        res = drv.prefill(row, prompt)
        tokens: list[int] = []
        logprobs: list[torch.Tensor] = []
        for i in range(n):
            lp = torch.log_softmax(res.logits_output.next_token_logits[-1].float(), dim=-1)
            logprobs.append(lp)
            tok = int(lp.argmax()) if forced is None else forced[i]
            tokens.append(tok)
            if i + 1 < n:
                res = drv.decode([row], [tok])
        return tokens, logprobs
    finally:
        drv.release_all()


LLAMA_N_PROBS = 50  # alternatives llama-server returns per position (the exact token is looked up there)


def llama_cpp_row(binary: str, gguf: str, threads: int, prompts: list[list[int]],
                  reference: list[tuple[list[int], list[torch.Tensor]]]) -> dict[str, Any]:
    """The same comparison for llama.cpp on the same GGUF: one 1-token completion per position with the
    prompt + the exact mode's tokens so far (its prompt cache makes each a 1-token step)."""
    import httpx

    agree = total = missing = 0
    dlp: list[float] = []
    top5: list[float] = []
    with local_llama_server(binary, gguf, threads, parallel=1, ctx=4096, flash_attn=False) as base, \
            httpx.Client(timeout=120) as client:
        for p, (ref_tokens, ref_lps) in zip(prompts, reference):
            for i, t in enumerate(ref_tokens):
                body = {"prompt": p + ref_tokens[:i], "n_predict": 1, "n_probs": LLAMA_N_PROBS, "temperature": 0,
                        "cache_prompt": True}
                r = client.post(base + "/completion", json=body)
                r.raise_for_status()
                top = {int(x["id"]): float(x["logprob"]) for x in r.json()["completion_probabilities"][0]["top_logprobs"]}
                total += 1
                agree += max(top, key=top.get) == t
                if t in top:
                    dlp.append(abs(top[t] - float(ref_lps[i][t])))
                else:
                    missing += 1
                if i == 0:
                    ids = ref_lps[0].topk(5).indices.tolist()
                    top5.append(sum(abs(top[j] - float(ref_lps[0][j])) for j in ids if j in top) /
                                max(1, sum(j in top for j in ids)))
    return {"format": "llama.cpp", "quantization": f"its own kernels on the file ({missing} exact tokens outside "
            f"its top {LLAMA_N_PROBS})", "top1_agreement": round(agree / total, 4),
            "mean_abs_dlogprob": round(sum(dlp) / max(1, len(dlp)), 4),
            "first_pos_top5_abs_dlogprob": round(sum(top5) / max(1, len(top5)), 4), "positions": total}


def llama_cpp_python_row(python: str, gguf: str, threads: int, prompts: list[list[int]],
                         reference: list[tuple[list[int], list[torch.Tensor]]]) -> dict[str, Any]:
    """llama.cpp's drift through llama-cpp-python: every position of prompt + the exact mode's tokens in one
    eval (logits_all), the same comparison as ours."""
    seqs = [p + toks for p, (toks, _) in zip(prompts, reference)]
    rows = llama_cpp_python.logprobs(python, gguf, threads, seqs)
    agree = total = 0
    dlp: list[float] = []
    for p, (toks, lps), row in zip(prompts, reference, rows):
        for i, t in enumerate(toks):
            pos = len(p) - 1 + i  # the position whose logits predict toks[i]
            agree += row["argmax"][pos] == t
            total += 1
            dlp.append(abs(row["chosen"][pos] - float(lps[i][t])))
    return {"format": "llama.cpp", "quantization": f"its own kernels ({llama_cpp_python.version(python)})",
            "top1_agreement": round(agree / total, 4), "mean_abs_dlogprob": round(sum(dlp) / len(dlp), 4),
            "first_pos_top5_abs_dlogprob": None, "positions": total}


def _prompt_ids(tok: Any, text: str) -> list[int]:
    """The chat template's text as a chat prompt is tokenised (no extra BOS); a base model without a
    template (Gemma 3 270M) reads the plain text with its own special tokens, as a completion would."""
    if not tok.chat_template:
        return tok.encode(text)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if any(f not in FORMATS for f in formats):
        raise SystemExit(f"--formats: choose from {list(FORMATS)}")
    if not 1 <= args.num_prompts <= len(PROMPTS) or not 1 <= args.max_new_tokens <= 1024:
        raise SystemExit(f"--num-prompts must be 1..{len(PROMPTS)} and --max-new-tokens 1..1024")
    if args.llama_server:
        check_binary(args.llama_server, "--llama-server")
    exact = _runner(args.model_path, "none", args.threads, dtype="float32")  # the exact mode, on every CPU
    tok = get_tokenizer(exact.model_path)
    prompts = [_prompt_ids(tok, p) for p in PROMPTS[: args.num_prompts]]
    reference = [_trace(exact, p, None, args.max_new_tokens) for p in prompts]
    rows = []
    for fmt in formats:
        runner = _runner(args.model_path, FORMATS[fmt], args.threads)
        agree = total = 0
        dlp: list[float] = []
        top5: list[float] = []
        for p, (ref_tokens, ref_lps) in zip(prompts, reference):
            _, lps = _trace(runner, p, ref_tokens, args.max_new_tokens)
            for t, a, b in zip(ref_tokens, ref_lps, lps):
                agree += int(b.argmax()) == t
                total += 1
                dlp.append(abs(float(b[t]) - float(a[t])))
            ids = ref_lps[0].topk(5).indices
            top5.append(float((lps[0][ids] - ref_lps[0][ids]).abs().mean()))
        rows.append({"format": fmt, "quantization": runner.quant_report.summary(),
                     "top1_agreement": round(agree / total, 4), "mean_abs_dlogprob": round(sum(dlp) / len(dlp), 4),
                     "first_pos_top5_abs_dlogprob": round(sum(top5) / len(top5), 4), "positions": total})
    if args.llama_server:
        rows.append(llama_cpp_row(args.llama_server, exact.model_path, args.threads or 2, prompts, reference))
    if args.llama_cpp_python:
        rows.append(llama_cpp_python_row(args.llama_cpp_python, exact.model_path, args.threads or 2, prompts, reference))
    print(f"{args.num_prompts} chat prompts x {args.max_new_tokens} tokens, teacher-forced on the exact mode's "
          "greedy output (batch-1 decode steps)")
    print_table(rows)
    types = type_report.type_rows(exact.model_path)
    print_table(types, type_report.columns(types),
                title="\nper tensor type of the file: what auto runs, and its weights' distance from the file's")
    result = {"model": exact.model_path, "rows": rows, "tensor_types": types}
    if args.json:
        write_json(args.json, result)
    return result
