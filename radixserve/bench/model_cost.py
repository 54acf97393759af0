"""What one forward of a Llama-family model costs on paper (FLOPs, bytes) and its linear layers alone.

Used by `bench one-batch` to turn step times into achieved FLOP/s and GB/s:

    prefill of S tokens   ~ S * 2 * (linear weights per token) + attention (S^2 / 2 causal) + one LM-head row
    decode step, bs reqs  reads every weight once + every request's whole KV history, and does
                          bs * 2 * (linear weights) FLOPs: a few FLOPs per byte, far below the
                          machine's ridge point, so the step is memory-bound (the seed's point).

`time_linear_only()` multiplies `rows` random activations through the real weight matrices of one
decode step (every layer's qkv/o/gate_up/down, then the LM head) and nothing else, so
"decode step / linear-only" says how much of a step is the unavoidable weight traffic and how
much is everything else (attention over the KV cache, norms, RoPE, Python, ForwardBatch, sampling).
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.bench.common import time_fn
from radixserve.layers.kernel_mode import EXACT, KernelMode
from radixserve.layers.linear import PackableLinear
from radixserve.layers.moe import SparseMoeBlock
from radixserve.mem_cache.memory_pool import KVPool


def linear_layers(model: torch.nn.Module) -> list[PackableLinear]:
    """The projections one decode step runs, in execution order (LM head last); a MoE layer's dense part
    is its shared expert, if any (its routed experts: moe_blocks)."""
    mods: list[PackableLinear] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods += [attn.qkv_proj, attn.o_proj]
        dense = mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp
        if dense is not None:
            mods += [dense.gate_up_proj, dense.down_proj]
    mods.append(model.lm_head)
    return mods


def moe_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _active_expert_params(block: SparseMoeBlock) -> float:
    """Routed-expert weights one token multiplies by: its top-k experts' gate, up and down."""
    ex = block.experts
    return block.top_k * 3 * ex.hidden_size * ex.inter_per_rank


def layer_linear_params(model: torch.nn.Module) -> int:
    """Weights of the decoder layers' linear layers every token multiplies by (a MoE layer: its top-k
    experts, not all of them)."""
    dense = sum(m.num_weight_params() for m in linear_layers(model)[:-1])
    return int(dense + sum(_active_expert_params(b) for b in moe_blocks(model)))


def streamed_weight_bytes(model: torch.nn.Module, dtype: torch.dtype = torch.float32, low_bit: bool = False) -> int:
    """Weight bytes a decode step must read: every projection and the LM head (the embedding lookup
    touches a few rows only, so a tied embedding is not counted twice), and of a MoE layer's routed experts
    the top-k a batch-1 token chooses. `low_bit`: a few-row step of
    a runner with low-bit copies reads those (data + scales) instead of the float weights."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0.0
    for m in linear_layers(model):
        qw = getattr(m, "qweight", None)
        total += qw.nbytes() if low_bit and qw is not None else m.num_weight_params() * size
    for b in moe_blocks(model):  # one token reads its top-k experts' share of the layer's expert bytes
        ex = b.experts
        held = ex.low_bit_nbytes() if low_bit and ex.low_bit is not None else 3 * ex.num_local * ex.hidden_size * \
            ex.inter_per_rank * size
        total += held * b.top_k / b.num_experts
    return int(total)


def prefill_flops(cfg: Any, model: torch.nn.Module, prompt_len: int, num_reqs: int = 1) -> float:
    """FLOPs of one PREFILL of `num_reqs` prompts of `prompt_len` tokens (useful work only).

    Linear layers: 2 per weight per token. Attention: QK^T and PV over the causal triangle,
    2 * 2 * heads * head_dim per (query, key) pair. LM head: one row per request (the logits
    processor keeps only each request's last position)."""
    linear = 2.0 * layer_linear_params(model) * prompt_len
    pairs = prompt_len * (prompt_len + 1) / 2
    attention = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size
    return num_reqs * (linear + attention + lm_head)


def kv_bytes_per_token(cfg: Any, dtype: torch.dtype = torch.float32) -> int:
    return KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)


def decode_bytes(cfg: Any, weight_bytes: int, batch_size: int, context_len: int,
                 dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes a DECODE step must read at least: every weight once (shared by the batch; the tied
    embedding counted once, as the LM head reads it whole) and each request's KV history."""
    kv = batch_size * (context_len + 1) * kv_bytes_per_token(cfg, dtype)
    return {"weight_bytes": int(weight_bytes), "kv_bytes": int(kv), "total_bytes": int(weight_bytes + kv)}


@torch.inference_mode()
def time_linear_only(model: torch.nn.Module, rows: int, repeats: int = 3, warmup: int = 1,
                     mode: KernelMode = EXACT) -> dict[str, float]:
    """Median time of one decode step's matmuls alone at `rows` rows, with the real weights and the
    kernels `mode` picks (the runner's KernelMode: what its forward runs; dense or oneDNN-packed floats)."""
    mods = linear_layers(model)
    ref = next(model.parameters())
    dtype, device = ref.dtype, ref.device
    # Inputs of the right width for each matrix (values do not matter to the time).
    widths = {m.weight_dims()[1] for m in mods}
    xs = {w: torch.randn(rows, w, dtype=dtype, device=device) for w in widths}

    def run() -> None:
        for m in mods:
            m.matmul(xs[m.weight_dims()[1]], None, mode)

    times = time_fn(run, repeats=repeats, warmup=warmup, device=device)
    times.sort()
    seconds = times[len(times) // 2]
    params = sum(m.num_weight_params() for m in mods)
    nbytes = params * ref.element_size()
    flops = 2.0 * rows * params
    return {"rows": rows, "ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9, "gflops": flops / seconds / 1e9}
