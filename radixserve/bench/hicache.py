"""bench hicache: the time to first token of a long prompt computed, restored from the disk tier after a
restart, and hit in memory, on one real server (`--enable-hierarchical-cache`).

    radixserve bench hicache --prompt-len 8000 --prompts 3 [--model-path FILE] [-- more serve flags]

Round 1 computes each prompt (distinct random token ids: no prefix is shared) and stops the server with
SIGTERM, which saves its radix cache to the directory. Round 2 restarts the server on the same directory
and sends the same prompts twice: first from disk (the block files in the page cache, as right after a
restart; `--cold` drops their pages first, posix_fadvise DONTNEED, as after a reboot), then from memory.
A request is `max_tokens: 1`, so its latency is its time to first token.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import httpx

from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.scale import drop_page_cache
from radixserve.bench.server_process import local_radixserve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench hicache", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--prompt-len", type=int, default=8000, help="tokens per prompt, 64..131072")
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts, 1..64 (the median is reported)")
    p.add_argument("--kv-cache-dtype", default="bfloat16", help="the server's --kv-cache-dtype")
    p.add_argument("--storage-dir", default=None, help="the disk tier's directory (default: a fresh temporary one, "
                   "removed at the end)")
    p.add_argument("--cold", action="store_true", help="drop the block files' pages before round 2 (as after a "
                   "reboot), not only restart the server")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("serve_args", nargs="*", help="more `radixserve serve` flags, after --")
    return p


def check_args(a: argparse.Namespace) -> None:
    if not 64 <= a.prompt_len <= 131072:
        raise SystemExit(f"--prompt-len must be in [64, 131072], got {a.prompt_len}")
    if not 1 <= a.prompts <= 64:
        raise SystemExit(f"--prompts must be in [1, 64], got {a.prompts}")


def _ttft(base: str, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    r = httpx.post(base + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0}, timeout=3600)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        raise SystemExit(f"the server answered {r.status_code}: {r.text[:500]}")
    return dt, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _drop_pages(folder: str) -> None:
    for path in glob.glob(os.path.join(folder, "**", "*.kv"), recursive=True):
        drop_page_cache(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    check_args(a)
    storage = a.storage_dir or tempfile.mkdtemp(prefix="rs-bench-hicache-")
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 30000) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    serve = [*(["--model-path", a.model_path] if a.model_path else []), "--enable-hierarchical-cache",
             "--hicache-storage-dir", storage, "--kv-cache-dtype", a.kv_cache_dtype, "--context-length",
             str(a.prompt_len + 64), "--max-total-tokens", str(a.prompt_len * a.prompts + 1024), *a.serve_args]
    try:
        with local_radixserve(serve) as base:
            computed = [_ttft(base, p) for p in prompts]
        if a.cold:
            _drop_pages(storage)
        with local_radixserve(serve) as base:
            restored = [_ttft(base, p) for p in prompts]
            memory = [_ttft(base, p) for p in prompts]
            info = httpx.get(base + "/get_server_info", timeout=60).json().get("hicache", {})
    finally:
        if a.storage_dir is None:
            shutil.rmtree(storage, ignore_errors=True)
    med = {name: statistics.median(t for t, _ in runs) for name, runs in
           (("computed", computed), ("restored", restored), ("memory", memory))}
    labels = {"computed": "computed", "restored": "restored from disk" + (" (cold)" if a.cold else ""),
              "memory": "memory hit"}
    runs = {"computed": computed, "restored": restored, "memory": memory}
    rows = [{"prompt": f"{a.prompt_len} tokens", "path": labels[k], "TTFT s": round(med[k], 3),
             "cached tokens": min(c for _, c in runs[k]), "of computed": round(med[k] / med["computed"], 3)}
            for k in labels]
    print(f"{machine_info('cpu').get('cpu', '')}  |  KV {a.kv_cache_dtype}  |  disk tier: "
          f"{info.get('storage_blocks', 0)} blocks, {info.get('storage_bytes', 0) / 2**20:.0f} MiB")
    print_table(rows)
    result = {"args": vars(a), "machine": machine_info("cpu"), "ttft_s": med, "hicache": info, "table": rows,
              "restored_over_computed": med["restored"] / med["computed"]}
    write_json(a.json, result)
    return result
