"""bench lora: many LoRA adapters on one base model, against the base alone, on the same workload.

It writes N random rank-R PEFT adapters of the model (every projection, like a full fine-tune's adapter),
starts `radixserve serve --lora-paths ...`, and runs `bench serving` twice on the same random workload:
requests spread round-robin over the N adapters (`--lora-adapters`), then all on the base model. It
reports both output tok/s, their ratio (the issue asks >= 0.8 at concurrency 32 over 8 rank-16
adapters), the TPOT difference (the per-step cost of the deltas as a client sees it), and a micro
measurement of the LoRA matmul itself: one decode step's deltas (every projection of every layer) for
`concurrency` rows spread over the N adapters.

    radixserve bench lora [--model-path M] [--num-adapters 8 --rank 16 --concurrency 32 --num-requests 96]
    radixserve bench lora --quick            # 2 adapters, rank 8, 4 short requests: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

from radixserve.bench import serving
from radixserve.bench.common import print_kv, write_json
from radixserve.bench.server_process import local_radixserve
from radixserve.kernels.cpu import load_cpu_ops
from radixserve.lora.lora_adapter import LoRAAdapter, LoRAWeights, stack_shards
from radixserve.lora.lora_batch import LoRABatch, torch_lora_apply
from radixserve.lora.lora_config import LoRAConfig
from radixserve.lora.lora_dense import DenseCache
from radixserve.model_loader import get_model_config
from radixserve.model_executor.model_runner import resolve_dtype
from radixserve.model_loader.default_model import default_model_path

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _module_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """HF projection -> (out, in) of a Llama-style decoder layer."""
    q, kv, h, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}


def write_random_adapters(model_path: str, out_dir: str, num: int, rank: int, seed: int = 0) -> dict[str, str]:
    """`num` PEFT adapters (adapter_config.json + adapter_model.safetensors) of `model_path`: name -> folder."""
    from safetensors.torch import save_file


    cfg = get_model_config(model_path)
    shapes = _module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, str] = {}
    for k in range(num):
        folder = os.path.join(out_dir, f"lora{k}")
        os.makedirs(folder, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for name, (o, i) in shapes.items():
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, i, generator=gen) * i**-0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * 0.01
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_TARGETS),
                       "bias": "none", "base_model_name_or_path": model_path}, f)
        out[f"lora{k}"] = folder
    return out


def _weights(shards: list[int], in_f: int, rank: int) -> LoRAWeights:
    """Random weights of one projection laid out as load_adapter lays them (stack_shards): `rank` ranks per
    stacked shard (output rows per shard: qkv's q, k, v; gate_up's gate, up)."""
    starts = [sum(shards[:k]) for k in range(len(shards))]
    pieces = [(o0, torch.randn(rank, in_f), torch.randn(rows, rank)) for o0, rows in zip(starts, shards)]
    return stack_shards(pieces, sum(shards), 1.0, torch.float32, torch.device("cpu"))


def lora_matmul_step_ms(model_path: str, num: int, rank: int, rows: int, repeats: int = 20,
                        dtype: torch.dtype | None = None) -> float:
    """ms for one decode step's LoRA deltas: `rows` rows (one per request) round-robin over `num` adapters,
    every projection of every layer in our stacked layout, through the path the server takes (LoRABatch: few
    rows side by side, by lora_sgmv where the C++ kernels load; segmented otherwise), with the adapters held in
    `dtype` (default: what the server's --dtype auto picks on this machine)."""
    if dtype is None:
        dtype = resolve_dtype("auto", torch.device("cpu"))

    cfg = get_model_config(model_path)
    s = _module_shapes(cfg)
    # our projection -> (output rows of each stacked shard, in features)
    stacked = {"qkv": ([s["q_proj"][0], s["k_proj"][0], s["v_proj"][0]], cfg.hidden_size),
               "o": ([s["o_proj"][0]], s["o_proj"][1]),
               "gate_up": ([cfg.intermediate_size] * 2, cfg.hidden_size), "down": ([s["down_proj"][0]], s["down_proj"][1])}
    names = [f"{layer}.{n}" for layer in range(cfg.num_hidden_layers) for n in stacked]
    adapters = [LoRAAdapter(LoRAConfig(f"x{k}", "", rank, 2.0 * rank, False, None), k + 1,
                            {n: _weights(*stacked[n.split(".")[1]], rank) for n in names}) for k in range(num)]
    batch = LoRABatch.build([adapters[i % num] for i in range(rows)], [1] * rows, torch.device("cpu"),
                            torch_lora_apply, DenseCache(torch.float32, load_cpu_ops()[0], dtype))  # lora_sgmv where it runs
    assert batch is not None
    xs = {n: torch.randn(rows, i) for n, (shards, i) in stacked.items()}
    outs = {n: torch.zeros(rows, sum(shards)) for n, (shards, i) in stacked.items()}

    def step() -> None:
        for name in names:
            kind = name.split(".")[1]
            if batch.dense is not None:
                batch.dense.apply(name, xs[kind], outs[kind], None)
            else:
                for g in batch.groups:
                    torch_lora_apply(xs[kind], g.rows, g.adapter.weights[name], outs[kind])

    step()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - t) / repeats * 1e3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench lora", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="base model (default: the embedded default model)")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-len-range", default="128,256")
    p.add_argument("--output-len-range", default="64,128")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags, one string")
    p.add_argument("--quick", action="store_true", help="2 adapters, rank 8, 4 short requests (a smoke test)")
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:

    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_adapters, args.rank, args.concurrency, args.num_requests = 2, 8, 4, 4
        args.input_len_range, args.output_len_range = "16,32", "4,4"
    if not 1 <= args.num_adapters <= 64 or not 1 <= args.rank <= 256:
        raise SystemExit("--num-adapters must be in 1..64 and --rank in 1..256")
    model = args.model_path or default_model_path()
    with tempfile.TemporaryDirectory(prefix="rs-bench-lora-") as tmp:
        adapters = write_random_adapters(model, tmp, args.num_adapters, args.rank)
        server = ["--model-path", model, "--max-lora-rank", str(args.rank), "--max-loaded-loras",
                  str(args.num_adapters), "--max-loras-per-batch", str(args.num_adapters),
                  "--lora-paths", *(f"{n}={p}" for n, p in adapters.items()), *args.server_args.split()]
        with local_radixserve(server) as base_url:
            common = ["--base-url", base_url, "--dataset", "random", "--num-requests", str(args.num_requests),
                      "--concurrency", str(args.concurrency), "--input-len-range", args.input_len_range,
                      "--output-len-range", args.output_len_range, "--disable-tqdm", "--tokenizer", model]
            runs = {"lora": serving.main([*common, "--lora-adapters", *adapters])["metrics"],
                    "base": serving.main(common)["metrics"]}
    tput = {k: m["output_throughput"] for k, m in runs.items()}
    summary = {
        "adapters": args.num_adapters, "rank": args.rank, "concurrency": args.concurrency,
        "lora_output_tok_s": tput["lora"], "base_output_tok_s": tput["base"],
        "lora_over_base": tput["lora"] / tput["base"] if tput["base"] else 0.0,
        "tpot_ms_lora": runs["lora"]["tpot_ms"]["mean"], "tpot_ms_base": runs["base"]["tpot_ms"]["mean"],
        "lora_matmul_ms_per_decode_step": lora_matmul_step_ms(model, args.num_adapters, args.rank,
                                                               args.concurrency, repeats=3 if args.quick else 20),
        "failed": runs["lora"]["failed"] + runs["base"]["failed"],
    }
    print_kv(summary, title=f"bench lora: {args.num_adapters} x rank {args.rank} vs base ({os.path.basename(model)})")
    out = {"benchmark": "lora", "model": model, "config": vars(args), "summary": summary, "runs": runs}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
