"""bench kv-capacity: how many tokens a fixed KV budget holds with one pool for every layer and with the hybrid
sliding-window pool, and the longest prompt that then runs, on one model (default: the Gemma 3 270M file).

    radixserve bench kv-capacity --kv-budget-gib 0.25 --swa-full-tokens-ratio 0.1 [--model-path FILE]

Each configuration starts an Engine with `--cpu-kv-cache-gb BUDGET` (the KV pool's cap) and reads the pools'
sizes from get_server_info(). Then a prompt of (the full pool's tokens - 64) random token ids runs on the
hybrid configuration, one output token, to show the context fits; its time to first token is reported.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from radixserve.bench.common import machine_info, print_table, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench kv-capacity", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: the Gemma 3 270M file)")
    p.add_argument("--kv-budget-gib", type=float, default=0.25, help="the KV pool's budget, (0, 64] GiB")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=0.1, help="the hybrid pool's ratio, (0, 1]")
    p.add_argument("--kv-cache-dtype", default="bfloat16", help="the KV cache's dtype")
    p.add_argument("--no-long-prompt", action="store_true", help="report the sizes only")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def check_args(a: argparse.Namespace) -> None:
    if not 0 < a.kv_budget_gib <= 64:
        raise SystemExit(f"--kv-budget-gib must be in (0, 64], got {a.kv_budget_gib}")
    if not 0 < a.swa_full_tokens_ratio <= 1:
        raise SystemExit(f"--swa-full-tokens-ratio must be in (0, 1], got {a.swa_full_tokens_ratio}")


def _pools(model: str, a: argparse.Namespace, hybrid: bool, context: int) -> dict[str, Any]:
    import radixserve  # lazy: torch only when the benchmark runs

    with radixserve.Engine(model_path=model, cpu_kv_cache_gb=a.kv_budget_gib, kv_cache_dtype=a.kv_cache_dtype,
                           context_length=context, disable_hybrid_swa_memory=not hybrid,
                           swa_full_tokens_ratio=a.swa_full_tokens_ratio, max_running_requests=4,
                           show_progress=False) as eng:
        info = eng.get_server_info()
    return {"full_tokens": info["max_total_num_tokens"], "swa": info.get("swa")}


def _long_prompt(model: str, a: argparse.Namespace, length: int) -> dict[str, Any]:
    import radixserve  # lazy: as above

    rng = random.Random(0)
    prompt = [rng.randrange(300, 30000) for _ in range(length)]
    with radixserve.Engine(model_path=model, cpu_kv_cache_gb=a.kv_budget_gib, kv_cache_dtype=a.kv_cache_dtype,
                           context_length=length + 64, swa_full_tokens_ratio=a.swa_full_tokens_ratio,
                           max_running_requests=4, show_progress=False) as eng:
        t = time.perf_counter()
        out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        ttft = time.perf_counter() - t
        info = eng.get_server_info()
    return {"prompt_tokens": out["meta_info"]["prompt_tokens"], "ttft_s": ttft, "swa": info.get("swa"),
            "full_tokens": info["max_total_num_tokens"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    check_args(a)
    if a.model_path is None:
        from radixserve.model_loader.default_model import gemma3_270m_path  # lazy: finds the installed file

        a.model_path = gemma3_270m_path()
    context = 1 << 20  # the pools, not the context, bound what fits here
    full = _pools(a.model_path, a, False, context)
    hybrid = _pools(a.model_path, a, True, context)
    gib = a.kv_budget_gib
    rows = [{"pool": "one pool (--disable-hybrid-swa-memory)", "KV slots": full["full_tokens"],
             "local slots": "-", "tokens per GiB": round(full["full_tokens"] / gib)},
            {"pool": f"hybrid, ratio {a.swa_full_tokens_ratio}", "KV slots": hybrid["full_tokens"],
             "local slots": (hybrid["swa"] or {}).get("swa_tokens", "-"),
             "tokens per GiB": round(hybrid["full_tokens"] / gib)}]
    gain = hybrid["full_tokens"] / full["full_tokens"]
    long = None
    if not a.no_long_prompt:
        long = _long_prompt(a.model_path, a, hybrid["full_tokens"] - 64)
    print(f"{machine_info('cpu').get('cpu', '')}  |  KV {a.kv_cache_dtype}, budget {gib} GiB  |  {a.model_path}")
    print_table(rows)
    print(f"hybrid / one pool: {gain:.2f}x the tokens")
    if long is not None:
        print(f"longest prompt run on the hybrid pool: {long['prompt_tokens']} tokens (one pool holds "
              f"{full['full_tokens']}), TTFT {long['ttft_s']:.1f} s, "
              f"{long['swa']['swa_tombstoned_tokens']} tokens' local KV given up on the way")
    result = {"args": vars(a), "machine": machine_info("cpu"), "one_pool": full, "hybrid": hybrid,
              "tokens_gain": gain, "long_prompt": long, "table": rows}
    write_json(a.json, result)
    return result
