"""bench moe: a mixture-of-experts model on the CPU against llama.cpp, and against its dense twin.

Builds a random-weight MoE with a real small MoE's shape scaled to this machine (default: hidden 1024,
16 layers, 32 experts of 512, top-4; GQA 16 / 4 heads; SmolLM2's 49,152-token vocabulary and tokenizer, so
llama.cpp can load it) as a GGUF in llama.cpp's Mixtral layout (`llama` + expert tensors), and the same
shape made dense with the same active parameters (one MLP of top_k x expert size). Both are quantised to
--preset by llama.cpp's own `llama-quantize` (K-quant presets; Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 can also be
written directly by the `gguf` package, no llama.cpp needed). Then, in one run on the same files and threads:

  * llama-bench pp512 / tg128 and radixserve's 512-token PREFILL and batch-1 DECODE at context 128
    (bench one-batch through the real ModelRunner, the default mode: the file's own blocks, experts through
    csrc/fused_experts.cpp), for the MoE and the dense twin;
  * the MoE decode step over the dense step, per engine: the cost should follow the active parameters;
  * the fraction of this machine's memory bandwidth (bench roofline's read-only figure) batch-1 decode
    reaches: the bytes a token must read in the file's own format (every tensor but the embedding, of the
    expert tensors the top-k share) times tokens/s.

    radixserve bench moe --llama-bench BIN/llama-bench --llama-quantize BIN/llama-quantize --threads 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

import gguf
import numpy as np

from radixserve.bench import peer
from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.roofline import measure_bandwidth
from radixserve.bench.scale_files import default_tokenizer_fields
from radixserve.model_loader.moe_config import MAX_EXPERTS, MAX_TOP_K

DIRECT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # presets gguf.quants writes without llama.cpp
K_PRESETS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench (omit: radixserve's figures only)")
    p.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (needed for the K-quant presets)")
    p.add_argument("--preset", default="Q4_K_M", help=f"one of {', '.join(K_PRESETS + DIRECT)}")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--expert-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="out/bench_moe", help="folder for the generated GGUF files")
    p.add_argument("--json", default=None)
    return p


def check_args(a: argparse.Namespace) -> None:
    """Every bound, before anything is generated (SystemExit naming the flag)."""
    if a.preset not in K_PRESETS + DIRECT:
        raise SystemExit(f"--preset {a.preset!r}: choose from {', '.join(K_PRESETS + DIRECT)}")
    if a.preset not in DIRECT and not a.llama_quantize:
        raise SystemExit(f"--preset {a.preset} needs --llama-quantize (only {', '.join(DIRECT)} are written directly)")
    for tool in ("llama_bench", "llama_quantize"):
        path = getattr(a, tool)
        if path and not os.access(path, os.X_OK):
            raise SystemExit(f"--{tool.replace('_', '-')} {path}: not an executable file")
    block = 32 if a.preset in DIRECT else 256
    for flag, value, lo, hi in (("hidden", a.hidden, block, 16384), ("expert-size", a.expert_size, block, 65536),
                                ("layers", a.layers, 1, 256), ("experts", a.experts, 2, MAX_EXPERTS),
                                ("heads", a.heads, 1, 256), ("kv-heads", a.kv_heads, 1, 256),
                                ("threads", a.threads, 1, 1024), ("prompt-len", a.prompt_len, 1, 8192),
                                ("gen-len", a.gen_len, 1, 8192), ("repeats", a.repeats, 1, 100)):
        if not lo <= value <= hi:
            raise SystemExit(f"--{flag} must be in [{lo}, {hi}], got {value}")
    if a.hidden % block or a.expert_size % block:
        raise SystemExit(f"--hidden ({a.hidden}) and --expert-size ({a.expert_size}) must be multiples of {block} "
                         f"(the {a.preset} blocks)")
    if not 1 <= a.top_k <= min(a.experts, MAX_TOP_K):
        raise SystemExit(f"--top-k must be in [1, min(--experts, {MAX_TOP_K})], got {a.top_k}")
    if a.hidden % a.heads or a.heads % a.kv_heads or (a.hidden // a.heads) % 2:
        raise SystemExit(f"--heads ({a.heads}) must divide --hidden ({a.hidden}) into an even head size, and "
                         f"--kv-heads ({a.kv_heads}) must divide --heads")


def write_model(path: str, a: argparse.Namespace, dense: bool, qtype: str | None, seed: int = 0) -> None:
    """A random model of the benchmark's shape: F16 (qtype None, for llama-quantize) or `qtype` blocks."""
    rng = np.random.default_rng(seed)
    tok = default_tokenizer_fields()
    vocab = len(next(v for k, v, _, _ in tok if k == "tokenizer.ggml.tokens"))
    hd, inter = a.hidden // a.heads, a.top_k * a.expert_size if dense else a.expert_size
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random {'dense twin' if dense else 'MoE'} {a.hidden}x{a.layers}")
    for key, value in {"context_length": 4096, "embedding_length": a.hidden, "block_count": a.layers,
                       "feed_forward_length": inter, "attention.head_count": a.heads,
                       "attention.head_count_kv": a.kv_heads, "rope.dimension_count": hd, "vocab_size": vocab,
                       **({} if dense else {"expert_count": a.experts, "expert_used_count": a.top_k})}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)

    def add(name: str, *shape: int, quantise: bool = True) -> None:
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))  # norms
            return
        x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if qtype is None or not quantise:
            w.add_tensor(name, x if not quantise else x.astype(np.float16))
            return
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    h, q, kv = a.hidden, a.heads * hd, a.kv_heads * hd
    add("token_embd.weight", vocab, h)
    for i in range(a.layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", h)
        add(b + "attn_q.weight", q, h)
        add(b + "attn_k.weight", kv, h)
        add(b + "attn_v.weight", kv, h)
        add(b + "attn_output.weight", h, q)
        add(b + "ffn_norm.weight", h)
        if dense:
            add(b + "ffn_gate.weight", inter, h)
            add(b + "ffn_up.weight", inter, h)
            add(b + "ffn_down.weight", h, inter)
        else:
            add(b + "ffn_gate_inp.weight", a.experts, h, quantise=False)  # llama.cpp keeps the router float32
            add(b + "ffn_gate_exps.weight", a.experts, inter, h)
            add(b + "ffn_up_exps.weight", a.experts, inter, h)
            add(b + "ffn_down_exps.weight", a.experts, h, inter)
    add("output_norm.weight", h)
    add("output.weight", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_file(a: argparse.Namespace, dense: bool) -> str:
    """The benchmark's GGUF in --preset (kept in --out: the same arguments reuse it)."""
    name = f"{'dense' if dense else 'moe'}-{a.hidden}x{a.layers}-e{a.experts}x{a.expert_size}-k{a.top_k}"
    os.makedirs(a.out, exist_ok=True)
    final = os.path.join(a.out, f"{name}-{a.preset}.gguf")
    if os.path.exists(final):
        return final
    if a.preset in DIRECT:
        write_model(final + ".tmp", a, dense, a.preset)
    else:
        f16 = os.path.join(a.out, f"{name}-F16.gguf")
        write_model(f16, a, dense, None)
        proc = subprocess.run([a.llama_quantize, f16, final + ".tmp", a.preset, str(a.threads)], capture_output=True,
                              text=True, timeout=3600)
        os.remove(f16)
        if proc.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(final + ".tmp", final)
    return final


def active_bytes(path: str) -> tuple[int, dict[str, int]]:
    """(bytes a batch-1 token reads in the file's format, bytes per tensor type of the whole file): every
    tensor but the embedding (a lookup), of the expert tensors the top-k / experts share."""
    r = gguf.GGUFReader(path)
    experts = int(r.fields["llama.expert_count"].contents()) if "llama.expert_count" in r.fields else 0
    used = int(r.fields["llama.expert_used_count"].contents()) if experts else 0
    total, by_type = 0.0, {}
    for t in r.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        if t.name == "token_embd.weight":
            continue
        total += int(t.n_bytes) * (used / experts if "_exps." in t.name else 1.0)
    return int(total), by_type


def measure(path: str, a: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(model_path=path, threads=a.threads, prompt_len=a.prompt_len, context_len=128,
                            repeats=a.repeats, kv_cache_dtype="auto", dtype="auto", long_contexts="")
    out: dict[str, Any] = {"radixserve": peer.radixserve_figures("auto", ns)}
    if a.llama_bench:
        out["llama.cpp"] = peer.llama_bench(a.llama_bench, path, a.threads, a.prompt_len, a.gen_len)
    out["active_bytes"], out["bytes_by_type"] = active_bytes(path)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    check_args(a)
    files = {"moe": make_file(a, dense=False), "dense": make_file(a, dense=True)}
    res = {kind: measure(path, a) for kind, path in files.items()}
    bw = measure_bandwidth()["reduce_gb_per_s"]
    engines = ["radixserve"] + (["llama.cpp"] if a.llama_bench else [])
    rows = []
    for fig, label in (("pp", f"prefill {a.prompt_len} (tok/s)"), ("tg", "batch-1 decode (tok/s)")):
        for kind in ("moe", "dense"):
            row: dict[str, Any] = {"figure": label, "model": kind}
            for eng in engines:
                row[eng] = round(res[kind][eng][fig], 1)
            if a.llama_bench:
                row["radixserve / llama.cpp"] = round(res[kind]["radixserve"][fig] / res[kind]["llama.cpp"][fig], 2)
            rows.append(row)
    print(f"{a.preset}: hidden {a.hidden} x {a.layers} layers, {a.experts} experts of {a.expert_size}, top-{a.top_k} "
          f"(dense twin: MLP {a.top_k * a.expert_size})  |  threads {a.threads}  |  "
          f"llama.cpp {res['moe'].get('llama.cpp', {}).get('build', '-')}  |  {machine_info('cpu')}")
    print_table(rows)
    cost = [{"engine": eng, "moe decode step ms": round(1e3 / res["moe"][eng]["tg"], 2),
             "dense decode step ms": round(1e3 / res["dense"][eng]["tg"], 2),
             "moe / dense step": round(res["dense"][eng]["tg"] / res["moe"][eng]["tg"], 2),
             "moe decode: fraction of bandwidth": round(res["moe"]["active_bytes"] * res["moe"][eng]["tg"] / 1e9 / bw, 2)}
            for eng in engines]
    print_table(cost, title=f"\ndecode cost against the active parameters (a token reads "
                            f"{res['moe']['active_bytes'] / 2**20:.0f} MB of the MoE file, "
                            f"{res['dense']['active_bytes'] / 2**20:.0f} MB of the dense one; read bandwidth "
                            f"{bw:.1f} GB/s)")
    result = {"args": vars(a), "files": files, "results": res, "table": rows, "cost": cost,
              "read_bandwidth_gb_per_s": bw}
    write_json(a.json, result)
    return result
