"""bench scale: the models people serve on a CPU (3B-8B dense, a 7B MoE) in Q4_K_M, against llama.cpp.

For each shape (bench/scale_files.py writes a random-weight GGUF with its real shapes and llama.cpp's Q4_K_M mix),
in one run on the same file and threads:

  * time to ready (`/health` answers 200) with a cold page cache (the file's pages dropped with
    posix_fadvise DONTNEED) and a warm one, and the peak anonymous memory (RssAnon summed over the server's
    process group, polled every 50 ms: a mapped file's pages are the page cache's and not counted), for
    `radixserve serve` and `llama-server`; radixserve's first start (no weight cache: it repacks the file and
    writes the cache, model_loader/weight_cache.py) is timed on its own, before the cold and warm starts that map
    the cache (cold: the cache's pages dropped too);
  * prefill 512 and batch-1 decode (bench one-batch through the real ModelRunner; llama-bench pp512 / tg128);
  * the read rate of batch-1 decode: the bytes a token reads in the file's format (every tensor but the
    embedding; of the expert tensors the top-k's share) x tokens/s, against this machine's streaming read
    bandwidth (bench roofline's figure: a 2-thread reduction over a buffer far larger than the caches).

    radixserve bench scale --shapes llama-3.1-8b --llama-server BIN/llama-server --llama-bench BIN/llama-bench
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.bench import peer
from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.moe import active_bytes
from radixserve.bench.roofline import measure_bandwidth
from radixserve.bench.scale_files import SHAPES, scale_file
from radixserve.bench.server_process import free_port
from radixserve.model_loader.gguf_cache import cache_entry, weight_files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench scale", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama-3.2-3b,llama-3.1-8b,olmoe-1b-7b", help=f"some of {', '.join(SHAPES)}")
    p.add_argument("--llama-server", help="llama.cpp's llama-server (omit: radixserve's figures only)")
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench")
    p.add_argument("--threads", type=int, default=2, help="threads per engine (radixserve: split over its ranks)")
    p.add_argument("--tp-size", type=int, default=1, help="radixserve's tensor-parallel ranks (each maps the file "
                                                          "and keeps its slice)")
    p.add_argument("--context", type=int, default=8192, help="both servers' KV pool / context, in tokens")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs of each speed figure, and warm starts (the median)")
    p.add_argument("--skip", default="", help="parts to leave out: ready, speed")
    p.add_argument("--out", default="out/bench_scale", help="folder for the generated GGUF files (~2-5 GB each)")
    p.add_argument("--json", default=None)
    return p


def check_args(a: argparse.Namespace) -> list[str]:
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise SystemExit(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    for flag, value, lo, hi in (("threads", a.threads, 1, 1024), ("context", a.context, 256, 1 << 20),
                                ("prompt-len", a.prompt_len, 1, 8192), ("gen-len", a.gen_len, 1, 8192),
                                ("repeats", a.repeats, 1, 100), ("tp-size", a.tp_size, 1, 64)):
        if not lo <= value <= hi:
            raise SystemExit(f"--{flag} must be in [{lo}, {hi}], got {value}")
    for tool in ("llama_server", "llama_bench"):
        path = getattr(a, tool)
        if path and not os.access(path, os.X_OK):
            raise SystemExit(f"--{tool.replace('_', '-')} {path}: not an executable file")
    return shapes


def drop_page_cache(path: str) -> None:
    """Evict the file's clean pages from the page cache (no root needed), for a cold start."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _group_anon(pgid: int) -> int:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ProcessLookupError):
            continue
    return total


def time_to_ready(cmd: list[str], base: str, timeout_s: float = 1800.0,
                  wait_for: Callable[[], bool] | None = None) -> dict[str, float]:
    """Seconds from launch until `base`/health answers 200, and the peak anonymous bytes of the server's process
    group until then (and 2 s after: the KV pool and warm-up allocations). `wait_for`: the server is stopped only
    once it holds (at most `timeout_s`), e.g. when its weight cache is written."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    peak, ready = 0, None
    try:
        while ready is None:
            peak = max(peak, _group_anon(proc.pid))
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited with {proc.returncode} before it was ready: {' '.join(cmd)}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    ready = time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"not ready after {timeout_s:.0f} s: {' '.join(cmd)}")
            time.sleep(0.05)
        for _ in range(40):
            peak = max(peak, _group_anon(proc.pid))
            time.sleep(0.05)
        while wait_for is not None and not wait_for() and time.monotonic() - t0 < timeout_s:
            peak = max(peak, _group_anon(proc.pid))
            time.sleep(0.1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"ready_s": ready, "peak_anon_gib": peak / 2**30}


def _servers(a: argparse.Namespace, path: str) -> dict[str, tuple[list[str], str]]:
    port = free_port()
    out = {"radixserve": ([sys.executable, "-m", "radixserve", "serve", "--model-path", path, "--host", "127.0.0.1",
                           "--port", str(port), "--context-length", str(min(a.context, 4096)),
                           "--max-total-tokens", str(a.context), "--tp-size", str(a.tp_size),
                           "--num-threads", str(max(1, a.threads // a.tp_size))],
                          f"http://127.0.0.1:{port}")}
    if a.llama_server:
        port = free_port()
        out["llama.cpp"] = ([a.llama_server, "-m", path, "-c", str(a.context), "-t", str(a.threads), "--host",
                             "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}")
    return out


def measure_shape(a: argparse.Namespace, name: str, bandwidth: float) -> dict[str, Any]:
    path = scale_file(name, a.out)
    res: dict[str, Any] = {"file": path, "file_gib": os.path.getsize(path) / 2**30}
    res["active_bytes"], res["bytes_by_type"] = active_bytes(path)
    if "ready" not in a.skip:
        entry = cache_entry(path)
        for eng, (cmd, base) in _servers(a, path).items():
            first = None
            if eng == "radixserve" and entry is not None:
                # a first start repacks and writes the weight cache; the cold and warm starts after it map that
                for f in weight_files(entry) + weight_files(entry, ".json"):
                    os.unlink(f)
                drop_page_cache(path)
                first = time_to_ready(cmd, base, wait_for=lambda: len(weight_files(entry, ".json")) >= a.tp_size)
            for f in [path] + (weight_files(entry) if eng == "radixserve" and entry is not None else []):
                drop_page_cache(f)
            cold = time_to_ready(cmd, base)
            warm = [time_to_ready(cmd, base) for _ in range(a.repeats)]  # the files' pages are cached now
            res[eng] = {"cold_ready_s": cold["ready_s"],
                        "warm_ready_s": statistics.median(w["ready_s"] for w in warm),
                        "peak_anon_gib": max(r["peak_anon_gib"] for r in [cold, *warm])}
            if first is not None:
                res[eng].update(first_ready_s=first["ready_s"], first_peak_anon_gib=first["peak_anon_gib"])
    if "speed" not in a.skip:
        ns = argparse.Namespace(model_path=path, threads=a.threads, prompt_len=a.prompt_len, context_len=128,
                                repeats=a.repeats, kv_cache_dtype="auto", dtype="auto", long_contexts="")
        ours = peer.radixserve_figures("auto", ns)
        res.setdefault("radixserve", {}).update(pp=ours["pp"], tg=ours["tg"])
        if a.llama_bench:
            theirs = peer.llama_bench(a.llama_bench, path, a.threads, a.prompt_len, a.gen_len, a.repeats)
            res.setdefault("llama.cpp", {}).update(pp=theirs["pp"], tg=theirs["tg"], build=theirs["build"])
        for eng in ("radixserve", "llama.cpp"):
            if "tg" in res.get(eng, {}):
                res[eng]["read_gb_s"] = res["active_bytes"] * res[eng]["tg"] / 1e9
                res[eng]["fraction_of_bandwidth"] = res[eng]["read_gb_s"] / bandwidth
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    shapes = check_args(a)
    bandwidth = measure_bandwidth(mem_mb=1024)["reduce_gb_per_s"]
    results = {name: measure_shape(a, name, bandwidth) for name in shapes}
    rows = []
    for name, res in results.items():
        for eng in ("radixserve", "llama.cpp"):
            r = res.get(eng)
            if not r:
                continue
            rows.append({"model": name, "file GiB": round(res["file_gib"], 2), "engine": eng,
                         "ready first s": _r(r.get("first_ready_s")),
                         "ready cold s": _r(r.get("cold_ready_s")), "ready warm s": _r(r.get("warm_ready_s")),
                         "peak anon GiB": _r(r.get("peak_anon_gib"), 2),
                         f"prefill {a.prompt_len} tok/s": _r(r.get("pp")),
                         "decode tok/s": _r(r.get("tg"), 2), "read GB/s": _r(r.get("read_gb_s")),
                         "of bandwidth": _r(r.get("fraction_of_bandwidth"), 2)})
    print(f"threads {a.threads}  |  radixserve tp {a.tp_size}  |  KV/context {a.context}  |  streaming read "
          f"bandwidth {bandwidth:.1f} GB/s  |  {machine_info('cpu')}")
    print_table(rows)
    result = {"args": vars(a), "read_bandwidth_gb_per_s": bandwidth, "results": results, "table": rows}
    write_json(a.json, result)
    return result


def _r(v: float | None, nd: int = 1) -> float | str:
    return "-" if v is None else round(v, nd)
