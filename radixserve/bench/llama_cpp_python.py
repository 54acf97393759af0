"""A current llama.cpp as a benchmark peer, through PyPI's llama-cpp-python (it builds llama.cpp from source).

The February 2025 llama.cpp that ../shared/peers/build_llamacpp.sh builds predates Gemma 3 and Qwen3, so
for those files the peer is llama-cpp-python's `Llama` API, run in a Python interpreter of its own
(`--llama-cpp-python PYTHON`, e.g. a venv made with `pip install llama-cpp-python==0.3.36`): never a
runtime dependency of radixserve, and never imported into its process.

The child measures what llama-bench defines, on the same file and threads:
    pp   tokens/s of one `eval` of a prompt_len-token prompt into an empty context (n_batch = prompt_len)
    tg   tokens/s of gen_len single-token `eval`s from an empty context
    tg_at_ctx  (with --long-context N) tokens/s of 32 single-token evals after an N-token context
and, for bench accuracy, the log-softmax of every position of given token sequences (logits_all).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama

job = json.loads(sys.stdin.read())
n_ctx = max(job["n_ctx"], 64)
llm = Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"], n_ctx=n_ctx,
            n_batch=min(n_ctx, 2048), n_ubatch=min(n_ctx, 512), logits_all=job["kind"] == "logprobs",
            verbose=False)
vocab = llm.n_vocab()
out = {"n_vocab": vocab}
rng = np.random.default_rng(0)

def tokens(n):
    return rng.integers(100, min(vocab, 30000), n).tolist()

def best(f, repeats):
    return min(f() for _ in range(repeats))

if job["kind"] == "speed":
    def pp():
        llm.reset(); llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        t = time.perf_counter(); llm.eval(tokens(job["prompt_len"])); return time.perf_counter() - t
    def tg(start, n):
        def run():
            llm.reset(); llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            if start:
                llm.eval(tokens(start))
            t = time.perf_counter()
            for tok in tokens(n):
                llm.eval([tok])
            return time.perf_counter() - t
        return run
    out["pp"] = job["prompt_len"] / best(pp, job["repeats"])
    out["tg"] = job["gen_len"] / best(tg(0, job["gen_len"]), job["repeats"])
    for ctx in job["contexts"]:
        out[f"tg_at_{ctx}"] = 32 / best(tg(ctx, 32), max(1, job["repeats"] // 2))
else:
    rows = []
    for seq in job["seqs"]:
        llm.reset(); llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        llm.eval(seq)
        logits = np.array(llm.scores[: len(seq)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits).sum(axis=1, keepdims=True))
        lp = logits - lse
        rows.append({"argmax": lp.argmax(axis=1).tolist(),
                     "chosen": [float(lp[i, seq[i + 1]]) for i in range(len(seq) - 1)]})
    out["rows"] = rows
print("RESULT " + json.dumps(out))
"""


def _run(python: str, job: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    if not os.access(python, os.X_OK):
        raise SystemExit(f"--llama-cpp-python {python}: not an executable Python interpreter")
    proc = subprocess.run([python, "-c", _CHILD], input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"llama-cpp-python failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def speed(python: str, gguf: str, threads: int, prompt_len: int, gen_len: int, contexts: list[int],
          repeats: int = 3) -> dict[str, Any]:
    """{"pp", "tg", "tg_at_<ctx>"...: tokens/s, "build": "llama-cpp-python <version>"}."""
    n_ctx = max([prompt_len, gen_len, *(c + 40 for c in contexts)])
    out = _run(python, {"kind": "speed", "gguf": gguf, "threads": threads, "n_ctx": n_ctx, "prompt_len": prompt_len,
                        "gen_len": gen_len, "contexts": contexts, "repeats": repeats})
    out["build"] = "llama-cpp-python " + version(python)
    return out


def logprobs(python: str, gguf: str, threads: int, seqs: list[list[int]]) -> list[dict[str, Any]]:
    """Per sequence: llama.cpp's argmax at every position and the log-softmax of each next token."""
    n_ctx = max(len(s) for s in seqs) + 8
    return _run(python, {"kind": "logprobs", "gguf": gguf, "threads": threads, "n_ctx": n_ctx, "seqs": seqs})["rows"]


def version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                          text=True, timeout=120)
    return proc.stdout.strip() or "?"
