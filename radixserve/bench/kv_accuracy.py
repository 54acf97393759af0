"""bench kv-accuracy: how far an 8-bit KV cache drifts from a bf16 one, teacher-forced on the same tokens.

The bf16-KV run generates `--positions` greedy tokens after each prompt; the int8-KV run (q8_0 blocks, what
`--kv-cache-dtype int8` stores) reads the same tokens teacher-forced, one batch-1 DECODE step per token, so every
step attends over a history it wrote in 8 bits. At every position:

  top-1 agreement   the int8 run's argmax equals the bf16 run's token
  |Δ logprob|       |logprob_int8(t) - logprob_bf16(t)| of that token (mean and max)

Both runs use the same weights (`--quantization`, default auto) and kernels; only the KV dtype differs.
`--reference float32` compares with a float32 cache instead (and `--kv-dtype bfloat16` then measures how far
bf16 itself is from it): on a model whose greedy text is full of near-ties, the bf16 reference's own rounding
is part of any drift measured against it.

    radixserve bench kv-accuracy [--model-path FILE] [--prompts 2] [--positions 480] [--reference float32]
                                 [--lossless-row] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from radixserve.bench.accuracy import LLAMA_N_PROBS, PROMPTS, _prompt_ids, _runner, _trace
from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.server_process import local_llama_server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench kv-accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--prompts", type=int, default=2, help=f"1..{len(PROMPTS)}")
    p.add_argument("--positions", type=int, default=480, help="teacher-forced positions per prompt, 1..4000")
    p.add_argument("--kv-dtype", default="int8", choices=["int8", "fp8_e4m3", "float32", "bfloat16"],
                   help="the KV dtype compared with the reference (float32 against bf16: how far bf16 itself is "
                   "from it)")
    p.add_argument("--reference", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the reference run's KV dtype (llama.cpp's row stays q8_0 against its f16)")
    p.add_argument("--lossless-row", action="store_true",
                   help="also a float32 cache against the same bf16 reference: the agreement a cache with no rounding "
                   "of its own reaches on this text (the ceiling of any 8-bit cache's)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server: its q8_0-KV drift from its f16 "
                   "KV on the same file and tokens, same run")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    p.add_argument("--json", default=None)
    return p


def _llama_trace(binary: str, gguf: str, threads: int, prompts: list[list[int]], tokens: list[list[int]],
                 kv: str) -> list[dict[int, float]]:
    """llama.cpp's top logprobs at every teacher-forced position, with its KV in `kv` (f16 or q8_0; a quantised V
    needs its flash attention): one 1-token completion per position, its prompt cache making each a 1-token step."""
    import httpx  # lazy: only with --llama-server

    out = []
    with local_llama_server(binary, gguf, threads, parallel=1, ctx=4096, flash_attn=True,
                            extra=("-ctk", kv, "-ctv", kv)) as base, httpx.Client(timeout=120) as client:
        for p, toks in zip(prompts, tokens):
            for i in range(len(toks)):
                body = {"prompt": p + toks[:i], "n_predict": 1, "n_probs": LLAMA_N_PROBS, "temperature": 0,
                        "cache_prompt": True}
                r = client.post(base + "/completion", json=body)
                r.raise_for_status()
                top = r.json()["completion_probabilities"][0]["top_logprobs"]
                out.append({int(x["id"]): float(x["logprob"]) for x in top})
    return out


def llama_row(binary: str, gguf: str, threads: int, prompts: list[list[int]], tokens: list[list[int]]) -> dict:
    """llama.cpp's q8_0 KV against its f16 KV on our tokens: the same two figures as ours."""
    f16 = _llama_trace(binary, gguf, threads, prompts, tokens, "f16")
    q8 = _llama_trace(binary, gguf, threads, prompts, tokens, "q8_0")
    flat = [t for toks in tokens for t in toks]
    agree = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(f16, q8))
    d = [abs(b[t] - a[t]) for a, b, t in zip(f16, q8, flat) if t in a and t in b]
    return {"KV": "llama.cpp q8_0 vs its f16", "positions": len(flat), "top-1 agreement": round(agree / len(flat), 4),
            "mean |Δ logprob|": round(sum(d) / max(1, len(d)), 5), "max |Δ logprob|": round(max(d, default=0.0), 4)}


def _compare(runner: Any, kv_dtype: str, reference: str, prompts: list[list[int]],
             traces: list[tuple[list[int], list[torch.Tensor]]], positions: int) -> tuple[dict, int, torch.Tensor]:
    """`runner` (KV in `kv_dtype`) teacher-forced on the reference's tokens: its table row, agreements and |Δ|s."""
    agree, deltas = 0, []
    for p, (tokens, ref_lp) in zip(prompts, traces):
        _, lp = _trace(runner, p, tokens, positions)
        for t, x, y in zip(tokens, ref_lp, lp):
            agree += int(int(y.argmax()) == t)
            deltas.append(abs(float(y[t]) - float(x[t])))
    d = torch.tensor(deltas)
    names = {"int8": "int8 (q8_0)", "bfloat16": "bf16"}
    row = {"KV": f"{names.get(kv_dtype, kv_dtype)} vs {names.get(reference, reference)}", "positions": len(deltas),
           "top-1 agreement": round(agree / len(deltas), 4),
           "mean |Δ logprob|": round(float(d.mean()), 5), "max |Δ logprob|": round(float(d.max()), 4)}
    return row, agree, d


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    if not 1 <= a.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in [1, {len(PROMPTS)}], got {a.prompts}")
    if not 1 <= a.positions <= 4000:
        raise SystemExit(f"--positions must be in [1, 4000], got {a.positions}")
    if a.kv_dtype == a.reference:
        raise SystemExit(f"--kv-dtype {a.kv_dtype} is the reference's own dtype: nothing to compare")
    if a.lossless_row and "float32" in (a.kv_dtype, a.reference):
        raise SystemExit("--lossless-row adds a float32 cache against the bf16 reference: not beside a float32 one")
    from radixserve.model_loader import get_tokenizer  # lazy: as above

    ref = _runner(a.model_path, a.quantization, None, kv_cache_dtype=a.reference, max_total_tokens=4200)
    tok = get_tokenizer(ref.model_path)
    prompts = [_prompt_ids(tok, p) for p in PROMPTS[: a.prompts]]
    traces = [_trace(ref, p, None, a.positions) for p in prompts]
    del ref
    cand = _runner(a.model_path, a.quantization, None, kv_cache_dtype=a.kv_dtype, max_total_tokens=4200)
    row, agree, d = _compare(cand, a.kv_dtype, a.reference, prompts, traces, a.positions)
    n = len(d)
    rows = [row]
    if a.lossless_row:
        del cand  # one model at a time
        cand = _runner(a.model_path, a.quantization, None, kv_cache_dtype="float32", max_total_tokens=4200)
        rows.append(_compare(cand, "float32", a.reference, prompts, traces, a.positions)[0])
    if a.llama_server:
        rows.append(llama_row(a.llama_server, cand.model_path, a.threads, prompts, [t for t, _ in traces]))
    print(f"{machine_info('cpu').get('cpu', '')}  |  {cand.model_path}  |  weights {a.quantization}")
    print_table(rows)
    result = {"args": vars(a), "machine": machine_info("cpu"), **row, "rows": rows, "top1_agreement": agree / n,
              "mean_abs_dlogprob": float(d.mean())}
    write_json(a.json, result)
    return result
