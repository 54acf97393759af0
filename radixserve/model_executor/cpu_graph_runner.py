"""CpuGraphRunner: DECODE steps of a few rows through one native call, the CPU's CUDA graph.

SGLang captures the decode step of each batch-size bucket as a CUDA graph so a step costs one launch
instead of hundreds. On a CPU the waste is the same in kind: at batch 1 the per-layer Python path
dispatches ~12 torch ops per layer (views, splits, the KV write, norms, RoPE, attention, four
linears), each with its own allocation and OpenMP fork/join, and that overhead was larger than the
low-bit linears themselves (measured on the 2-core AVX2 dev machine: ~12 ms of a ~20 ms step).

So when the runner has low-bit weights (--quantization auto / int8 / int4), the C++ kernels and the
cpu_paged attention backend, this object binds a `torch.classes.radixserve_cpu.DecodeStack`
(kernels/cpu/csrc/decode_stack.cpp) to the model's weights, norms, RoPE caches and KV pool once, and
`replay(forward_batch)` runs the whole decoder stack for a DECODE step (or a speculative TARGET_VERIFY
step: each request's last token plus its drafts) of any size the low-bit path takes (ModelRunner.quant_max_rows)
in that one call: the embedding lookup and the LM head stay in Python (the LM head through the same
low-bit path as every other step). The stack computes exactly what the per-layer path computes with
the same low-bit weights (same kernels in the same order; tests/model_executor/test_quantized_model.py
checks they agree bit for bit; tests/model_executor/test_decode_stack_architectures.py on every
architecture). It runs a model whose every layer declares (CausalLM.layer_arithmetic) what it implements,
models/base.py's DECODE_STACK_LAYERS: Llama / Qwen2 / Mistral layers, Qwen3's QK-norm, Gemma 2/3's sandwich
norms and GELU-tanh, any sliding window and attention soft-cap, each layer with its own RoPE base (Gemma 3);
not partial rotary (Phi-3's). `--disable-cpu-graph` turns it off.

The runner decides *how* a step runs, never *who* runs: can_run() looks only at the ForwardBatch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
from radixserve.layers.moe import SparseMoeBlock
from radixserve.models.base import DECODE_STACK_LAYERS, LayerArithmetic

if TYPE_CHECKING:
    from radixserve.layers.logits_processor import LogitsProcessorOutput
    from radixserve.lora.lora_dense import DenseWeights
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.int64)


def _arithmetic_tensors(layer: Any, arithmetic: LayerArithmetic) -> list[torch.Tensor]:
    """DecodeStack.add_layer's `arith`: the layer's RoPE caches, then its QK-norm and sandwich-norm weights
    where its declared arithmetic has them (empty: none)."""
    attn = layer.self_attn
    rope = attn.rotary_emb  # its RoPE base's (Gemma 3: local and global layers differ)
    qk = [attn.q_norm.weight.data, attn.k_norm.weight.data] if arithmetic.qk_norm else [_EMPTY, _EMPTY]
    ff = ([layer.pre_feedforward_layernorm.weight.data, layer.post_feedforward_layernorm.weight.data]
          if arithmetic.norms == "sandwich" else [_EMPTY, _EMPTY])
    return [rope.cos_cache, rope.sin_cache, *qk, *ff]


def _projections(layer: Any) -> list[Any]:
    """The projections the stack runs, in its order: qkv, o and a dense MLP's gate_up, down (a MoE layer's
    experts: _moe_tensors)."""
    attn, mlp = layer.self_attn, layer.mlp
    dense = [] if isinstance(mlp, SparseMoeBlock) else [mlp.gate_up_proj, mlp.down_proj]
    return [attn.qkv_proj, attn.o_proj, *dense]


def _moe_tensors(block: SparseMoeBlock) -> tuple[list[torch.Tensor], list[int]]:
    """DecodeStack.add_moe_layer's `moe` and `ints`: the router and the stacked low-bit experts."""
    assert block.experts.low_bit is not None
    w13, w2 = block.experts.low_bit
    moe = [block.gate.weight.data, w13.data, w13.d, w13.m if w13.m is not None else _EMPTY,
           w2.data, w2.d, w2.m if w2.m is not None else _EMPTY]
    return moe, [block.top_k, int(block.renormalize), w13.kind, w2.kind, block.experts.inter_per_rank]


class CpuGraphRunner:
    def __init__(self, runner: ModelRunner, stack: Any) -> None:
        self.model = runner.model
        self.stack = stack
        self.max_rows = runner.low_bit_row_limit()  # None: any number of rows
        self.replays = 0
        self.lora_replays = 0  # of those, steps with adapter rows (their deltas inside the stack)
        # cumulative seconds of a replay's three parts: what `bench one-batch --profile` splits a step into
        self.timers = {"embed_s": 0.0, "stack_s": 0.0, "logits_s": 0.0}
        # each layer's four projections by module name: what LoRA weights are keyed by (lora_dense.py)
        names = {id(m): n for n, m in self.model.named_modules()}
        self._proj_names = [[names[id(p)] for p in _projections(layer)] for layer in self.model.model.layers]
        self._moe_layers = [i for i, layer in enumerate(self.model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        self._lora_bound: dict[str, DenseWeights] | None = None  # the adapter set the stack holds now

    @classmethod
    def maybe_create(cls, runner: ModelRunner) -> CpuGraphRunner | None:
        why = cls._unsupported(runner)
        if why is not None:
            if runner.quant_ops is not None:
                logger.info("cpu graph: off (%s); decode runs layer by layer", why)
            return None
        stack = cls._build_stack(runner)
        logger.info("cpu graph: DECODE steps of <= %s rows run the whole decoder stack in one native call",
                    runner.quant_max_rows or "any number of")
        return cls(runner, stack)

    @staticmethod
    def _unsupported(runner: ModelRunner) -> str | None:
        """None when this runner's model and backend can be bound to a DecodeStack, else why not."""
        if runner.server_args.disable_cpu_graph:
            return "--disable-cpu-graph"
        if runner.quant_ops is None:
            return "no low-bit weights"
        if not isinstance(runner.attn_backend, CpuPagedAttnBackend):
            return "needs the cpu_paged attention backend"
        if not hasattr(torch.classes.radixserve_cpu, "DecodeStack"):
            return "the loaded kernel library has no DecodeStack"
        if runner.server_args.ranks_per_replica != 1:
            return f"tp_size * pp_size = {runner.server_args.ranks_per_replica} (the native stack is single-rank)"
        model, inner = runner.model, runner.model.model
        pool = runner.token_to_kv_pool
        if pool.hybrid and {i for i in inner.stage_layers if model.layer_arithmetic(i).sliding_window} != set(
                pool.swa_layer_ids):  # the stack sends every windowed layer to the sliding-window buffers
            return "the layers with a window are not exactly the sliding-window pool's"
        for i in inner.stage_layers:
            arithmetic = model.layer_arithmetic(i)
            if arithmetic not in DECODE_STACK_LAYERS:
                outside = ", ".join(DECODE_STACK_LAYERS.outside(arithmetic))
                return f"layer {i} computes {arithmetic}, which the native stack does not implement ({outside})"
        for i in inner.stage_layers:
            layer = inner.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            if any(p.qweight is None for p in _projections(layer)):
                return "a projection has no low-bit copy"
            if isinstance(mlp, SparseMoeBlock):
                if mlp.experts.low_bit is None:
                    return f"layer {i}'s experts have no low-bit copy"
            elif mlp.down_proj.bias is not None:
                return "down_proj with a bias"
            if attn.o_proj.bias is not None:
                return "o_proj with a bias"
        return None

    @staticmethod
    def _build_stack(runner: ModelRunner) -> Any:
        cfg, model, inner = runner.model_config, runner.model, runner.model.model
        first = inner.layers[0].self_attn
        stack = torch.classes.radixserve_cpu.DecodeStack(
            cfg.hidden_size, first.qkv_proj.num_heads, first.qkv_proj.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, float(inner.norm.eps), float(first.attn.scaling), inner.norm.weight.data,
        )
        pool = runner.token_to_kv_pool
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            k_buf, v_buf = pool.get_kv_buffer(i)
            bias = attn.qkv_proj.bias.data if attn.qkv_proj.bias is not None else _EMPTY
            tensors = [layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data, bias,
                       k_buf, v_buf]
            kinds = []
            for proj in _projections(layer):
                qw = proj.qweight
                tensors += [qw.data, qw.d, qw.m if qw.m is not None else _EMPTY]
                kinds.append(qw.kind)
            # the stack computes what the layer declares (what _unsupported checked)
            arithmetic = model.layer_arithmetic(i)
            args = (_arithmetic_tensors(layer, arithmetic), arithmetic.sliding_window or 0,
                    float(arithmetic.logit_cap or 0.0), arithmetic.activation)
            if isinstance(layer.mlp, SparseMoeBlock):  # the dense MLP's slots: unused placeholders
                stack.add_moe_layer(tensors + [_EMPTY] * 6, kinds + [0, 0], *args, *_moe_tensors(layer.mlp))
            else:
                stack.add_layer(tensors, kinds, *args)
        return stack

    def can_run(self, fb: ForwardBatch) -> bool:
        """DECODE, or TARGET_VERIFY (each request's last token + its drafts), of <= max_rows rows; with
        adapter rows, when the step's adapters are laid side by side (few rows: LoRABatch.dense)."""
        lora = fb.lora_batch
        if lora is not None and (lora.dense is None or lora.dense.ops is None or self._moe_layers):
            return False  # the stack runs lora_sgmv's layout, and no adapters on a MoE model's layers
        mode = fb.forward_mode
        rows = fb.input_ids.shape[0]
        return ((mode.is_decode() or mode.is_target_verify()) and rows >= 1
                and (self.max_rows is None or rows <= self.max_rows)
                and CpuPagedAttnBackend.whole_step_rows(fb) is not None)

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        b = CpuPagedAttnBackend.whole_step_rows(fb)
        model = self.model
        lora = fb.lora_batch
        t0 = time.perf_counter()
        x = model.model.embed(fb.input_ids)
        t1 = time.perf_counter()
        pool = fb.token_to_kv_pool
        swa_loc = swa_kv = _EMPTY_LONG  # one pool: every layer reads the KV slots
        if pool.hybrid:  # its sliding-window layers (mem_cache/swa_memory_pool.py)
            swa_loc, swa_kv = pool.swa_table(fb.out_cache_loc), pool.swa_table(b.kv_indices)
        # M-RoPE: a decode row's three positions are one (its position + the request's delta)
        positions = fb.positions if fb.mrope_positions is None else fb.mrope_positions[0].contiguous()
        if lora is None:
            hidden = self.stack.forward(x, positions, fb.out_cache_loc, b.kv_indices, b.seq_lens, b.query_len,
                                        swa_loc, swa_kv)
        else:
            self._bind_lora(lora.dense.weights)
            hidden = self.stack.forward_lora(x, positions, fb.out_cache_loc, b.kv_indices, b.seq_lens,
                                             b.query_len, lora.dense.row_group, swa_loc, swa_kv)
            self.lora_replays += 1
        t2 = time.perf_counter()
        self.replays += 1
        if self._moe_layers and model.expert_load is not None:  # the step's expert load, as the layers add it
            model.expert_load.add_layers(self._moe_layers, self.stack.expert_counts())
        out = model.logits_processor(hidden, model.lm_head, fb)
        tm = self.timers
        tm["embed_s"] += t1 - t0
        tm["stack_s"] += t2 - t1
        tm["logits_s"] += time.perf_counter() - t2
        return out

    def _bind_lora(self, weights: dict[str, DenseWeights]) -> None:
        """Hand the stack this adapter set's side-by-side weights, once per set (DenseCache makes a new dict
        when the set changes; holding it keeps its identity from being reused)."""
        if weights is self._lora_bound:
            return
        flat: list[torch.Tensor] = []
        for names in self._proj_names:
            for name in names:
                w = weights.get(name)
                flat += [_EMPTY, _EMPTY, _EMPTY] if w is None else [w.A, w.Bt, w.blocks]
        self.stack.set_lora(flat)
        self._lora_bound = weights
