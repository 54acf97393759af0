"""bench kv-capacity: how many tokens a fixed KV budget holds with one pool for every layer and with the hybrid
sliding-window pool, in each KV dtype, and the longest prompt that then runs (default: the Gemma 3 270M file).

    radixserve bench kv-capacity --kv-budget-gib 0.25 --swa-full-tokens-ratio 0.1 --kv-dtypes bfloat16,int8

Each configuration starts an Engine with `--cpu-kv-cache-gb BUDGET` (the KV pool's cap) and reads the pools'
sizes from get_server_info(). Then a prompt of (the pool's tokens - 64) random token ids runs on the last one
(hybrid, the last dtype), one output token, to show the context fits; its time to first token is reported.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.server_args_checks import KV_CACHE_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench kv-capacity", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: the Gemma 3 270M file)")
    p.add_argument("--kv-budget-gib", type=float, default=0.25, help="the KV pool's budget, (0, 64] GiB")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=0.1, help="the hybrid pool's ratio, (0, 1]")
    p.add_argument("--kv-dtypes", default="bfloat16,int8", help=f"comma-separated, of {', '.join(KV_CACHE_DTYPES)}")
    p.add_argument("--no-long-prompt", action="store_true", help="report the sizes only")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def check_args(a: argparse.Namespace) -> list[str]:
    if not 0 < a.kv_budget_gib <= 64:
        raise SystemExit(f"--kv-budget-gib must be in (0, 64], got {a.kv_budget_gib}")
    if not 0 < a.swa_full_tokens_ratio <= 1:
        raise SystemExit(f"--swa-full-tokens-ratio must be in (0, 1], got {a.swa_full_tokens_ratio}")
    dtypes = [d.strip() for d in a.kv_dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in KV_CACHE_DTYPES for d in dtypes):
        raise SystemExit(f"--kv-dtypes: choose from {KV_CACHE_DTYPES}, got {a.kv_dtypes!r}")
    return dtypes


def _engine(model: str, a: argparse.Namespace, kv: str, hybrid: bool, context: int) -> Any:
    import radixserve  # lazy: torch only when the benchmark runs

    return radixserve.Engine(model_path=model, cpu_kv_cache_gb=a.kv_budget_gib, kv_cache_dtype=kv,
                             context_length=context, disable_hybrid_swa_memory=not hybrid,
                             swa_full_tokens_ratio=a.swa_full_tokens_ratio, max_running_requests=4,
                             show_progress=False)


def _pools(model: str, a: argparse.Namespace, kv: str, hybrid: bool, long: bool) -> dict[str, Any]:
    """A configuration's pool sizes; with `long`, then the longest prompt it holds (the pool's tokens - 64)."""
    with _engine(model, a, kv, hybrid, 1 << 20) as eng:  # the pools, not the context, bound what fits here
        info = eng.get_server_info()
        out = {"kv": kv, "hybrid": hybrid, "full_tokens": info["max_total_num_tokens"], "swa": info.get("swa")}
        if long:
            out["long_prompt"] = _long_prompt(eng, kv, out["full_tokens"] - 64)
    return out


def _long_prompt(eng: Any, kv: str, length: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompt = [rng.randrange(300, 30000) for _ in range(length)]
    t = time.perf_counter()
    out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    ttft = time.perf_counter() - t
    info = eng.get_server_info()
    return {"kv": kv, "prompt_tokens": out["meta_info"]["prompt_tokens"], "ttft_s": ttft, "swa": info.get("swa"),
            "full_tokens": info["max_total_num_tokens"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    dtypes = check_args(a)
    if a.model_path is None:
        from radixserve.model_loader.default_model import gemma3_270m_path  # lazy: finds the installed file

        a.model_path = gemma3_270m_path()
    # the last configuration (hybrid, the last dtype: the most tokens when int8 comes last) also runs the long prompt
    plan = [(hybrid, kv) for hybrid in (False, True) for kv in dtypes]
    configs = [_pools(a.model_path, a, kv, hybrid, not a.no_long_prompt and i == len(plan) - 1)
               for i, (hybrid, kv) in enumerate(plan)]
    base = configs[0]["full_tokens"]
    gib = a.kv_budget_gib
    rows = [{"pool": f"hybrid, ratio {a.swa_full_tokens_ratio}" if c["hybrid"] else "one pool", "KV dtype": c["kv"],
             "KV slots": c["full_tokens"], "local slots": (c["swa"] or {}).get("swa_tokens", "-"),
             "tokens per GiB": round(c["full_tokens"] / gib), f"vs one pool {dtypes[0]}": round(
                 c["full_tokens"] / base, 2)} for c in configs]
    long = configs[-1].pop("long_prompt", None)
    print(f"{machine_info('cpu').get('cpu', '')}  |  KV budget {gib} GiB  |  {a.model_path}")
    print_table(rows)
    if long is not None:
        print(f"longest prompt run ({long['kv']}, hybrid): {long['prompt_tokens']} tokens (one pool {dtypes[0]} holds "
              f"{base}), TTFT {long['ttft_s']:.1f} s, {long['swa']['swa_tombstoned_tokens']} tokens' local KV "
              "given up on the way")
    result = {"args": vars(a), "machine": machine_info("cpu"), "configs": configs, "long_prompt": long,
              "table": rows}
    write_json(a.json, result)
    return result
