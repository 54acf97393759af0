"""bench embeddings: /v1/embeddings of a real `radixserve serve --is-embedding` vs transformers' batched forward.

The same N short texts (default 1,000 of 8..24 tokens, random words) go through both:
- radixserve: POST /v1/embeddings in calls of --batch-size inputs, --concurrency calls in flight (HTTP,
  tokenisation, scheduling, pooling and JSON included; the scheduler packs the inputs of many calls into
  one EXTEND step);
- transformers: the same model in float32 (AutoModelForCausalLM's decoder, no LM head), the same texts
  tokenised by the same tokenizer in padded batches of --hf-batch-size, pooled and normalised the same way
  (tokenisation included).
It prints both throughputs, their ratio, and the largest difference between the two sets of vectors
(about 1e-6 with --exact, the float32 mode; the default mode runs the GGUF's own low-bit weights).

    radixserve bench embeddings [--num-inputs 1000] [--batch-size 64] [--concurrency 4] [--pooling last]
        [--exact] [--quick] [--json embeddings.json]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from radixserve.bench.common import machine_info, print_kv, print_table, write_json
from radixserve.bench.datasets import WordSource, load_tokenizer
from radixserve.bench.server_process import local_radixserve
from radixserve.model_loader import default_model_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench embeddings", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--num-inputs", type=int, default=1000)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=64, help="inputs per /v1/embeddings call")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight at once")
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers: inputs per padded forward")
    p.add_argument("--pooling", choices=("last", "mean"), default="last")
    p.add_argument("--exact", action="store_true", help="the server in float32 (--quantization none --dtype "
                   "float32): the vectors then equal transformers' to ~1e-6")
    p.add_argument("--server-args", default="", help="more `radixserve serve` flags, as one string")
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 inputs in calls of 16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def make_inputs(tokenizer: Any, n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = WordSource(tokenizer, rng)
    return [words.text(rng.randint(lo, hi))[0].strip() for _ in range(n)]


def run_server(base: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, list[list[float]], int]:
    """(seconds, vectors in input order, prompt tokens) of all texts through /v1/embeddings."""
    calls = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    with httpx.Client(base_url=base, timeout=600) as client:
        def one(chunk: list[str]) -> dict[str, Any]:
            r = client.post("/v1/embeddings", json={"input": chunk})
            if r.status_code != 200:
                raise SystemExit(f"/v1/embeddings answered {r.status_code}: {r.text[:500]}")
            return r.json()

        one(texts[:2])  # warm-up, untimed
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(one, calls))
        seconds = time.perf_counter() - t0
    vectors = [d["embedding"] for a in answers for d in sorted(a["data"], key=lambda d: d["index"])]
    return seconds, vectors, sum(a["usage"]["prompt_tokens"] for a in answers)


def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if os.path.isfile(path):  # a GGUF file: transformers dequantises it to float32
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder or ".", gguf_file=name, torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval().get_decoder()  # the decoder and its final norm: no LM head, as the server


@torch.inference_mode()
def run_hf(decoder: Any, tokenizer: Any, texts: list[str], batch: int, pooling: str) -> tuple[float, torch.Tensor]:
    """(seconds, [n, hidden] normalised float64 vectors): padded batches, pooled over each input's own tokens."""
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        ids = [tokenizer.encode(t, add_special_tokens=True) for t in texts[i : i + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])  # right padding
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        hidden = decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.double()  # [b, width, h]
        lens = mask.sum(1)
        if pooling == "last":
            vec = hidden[torch.arange(len(ids)), lens - 1]
        else:
            vec = (hidden * mask.unsqueeze(-1)).sum(1) / lens.unsqueeze(-1)
        out.append(torch.nn.functional.normalize(vec, dim=-1))
    return time.perf_counter() - t0, torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_inputs, args.batch_size, args.hf_batch_size = 64, 16, 16
    for name in ("num_inputs", "batch_size", "concurrency", "hf_batch_size", "min_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    if args.max_tokens < args.min_tokens:
        raise SystemExit("--max-tokens: must be >= --min-tokens")

    path = args.model_path or default_model_path()
    tokenizer = load_tokenizer(path)
    texts = make_inputs(tokenizer, args.num_inputs, args.min_tokens, args.max_tokens, args.seed)
    server_flags = ["--model-path", path, "--is-embedding", "--pooling", args.pooling,
                    "--max-prompts-per-request", str(max(args.batch_size, 2))]
    if args.exact:
        server_flags += ["--quantization", "none", "--dtype", "float32"]
    server_flags += args.server_args.split()
    with local_radixserve(server_flags) as base:
        rs_s, rs_vecs, tokens = run_server(base, texts, args.batch_size, args.concurrency)
    decoder = load_hf(path)
    run_hf(decoder, tokenizer, texts[:2], 2, args.pooling)  # warm-up, untimed
    hf_s, hf_vecs = run_hf(decoder, tokenizer, texts, args.hf_batch_size, args.pooling)
    diff = (torch.tensor(rs_vecs, dtype=torch.float64) - hf_vecs).abs().max().item()
    rows = [
        {"system": f"radixserve /v1/embeddings ({args.batch_size}/call, {args.concurrency} in flight)",
         "inputs": len(texts), "tokens": tokens, "seconds": rs_s, "inputs/s": len(texts) / rs_s,
         "tokens/s": tokens / rs_s},
        {"system": f"transformers forward (float32, batch {args.hf_batch_size}, padded)", "inputs": len(texts),
         "tokens": tokens, "seconds": hf_s, "inputs/s": len(texts) / hf_s, "tokens/s": tokens / hf_s},
    ]
    print_table(rows, title=f"embeddings of {len(texts)} inputs ({args.min_tokens}..{args.max_tokens} tokens), "
                f"pooling {args.pooling}, {'exact' if args.exact else 'default'} mode")
    summary = {"ratio radixserve / transformers": hf_s / rs_s, "max |vector difference|": diff}
    print_kv(summary)
    write_json(args.json, {"args": vars(args), "rows": rows, **summary, "machine": machine_info()})
