"""The model interface, and the shared pieces every architecture is built from.

What the rest of the engine relies on, and only this (ModelRunner, both loaders, pipeline stages, the
low-bit planner, the native decode stack):

    cls(cfg: ModelConfig, ps: ParallelState)          build this rank's / stage's part of the model
    forward(input_ids, positions, forward_batch, pp_proxy=None)
                                                      -> LogitsProcessorOutput (last stage) or PPProxyTensors
    load_weights(iterable of (HF name, float tensor)) every parameter filled, or a ValueError naming the gap
    holds_checkpoint_tensor(name) -> bool              which checkpoint tensors this pipeline stage reads
    checkpoint_sources(module name) -> [(name, shard)] the checkpoint tensors stacked into one projection
    layer_arithmetic(layer_id) -> LayerArithmetic      what a decoder layer computes (the decode stack runs
                                                      a model only when every layer is what it implements)
    model.embed_tokens / model.layers / model.norm / lm_head / logits_processor, model.embed_scale

The batch is passed explicitly to every layer that needs it (attention; the projections, which read the
runner's kernel choices and the step's LoRA rows from it), never read from a global; the step's RoPE rows
are cached on it too (ForwardBatch.rope_rows). Layers with a C++ twin (CpuKernelLayer: norms, RoPE, gated
activations) get their kernels once at load from the runner (enable_cpu_kernels), never per step. A
pipeline stage builds only its layers (ParallelState.stage_layers; the others are PPMissingLayer
placeholders that keep the checkpoint's numbering), the first stage the embedding, the last the final
norm and LM head; a stage after the first starts from the previous stage's PPProxyTensors.

An architecture is a small subclass of CausalLM: which pieces its decoder layer uses follows from its
ModelConfig (QK-norm, sandwich norms, activation, windows, soft-caps), so most architectures only name
their checkpoint's tensor layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.activation import gated_activation
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.moe import SparseMoeBlock
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.sharded_rms_norm import full_width_qk_norms
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.model_executor.forward_batch_info import PPProxyTensors

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_loader.model_config import ModelConfig


@dataclass(frozen=True)
class LayerArithmetic:
    """What one decoder layer computes: the declaration the native decode stack checks (never attribute
    names). Two layers with equal records compute the same function of their weights."""

    norms: str  # "pre": norm -> attention -> add, norm -> MLP -> add; "sandwich": four norms (Gemma 2/3)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    activation: str  # the gated MLP's: "silu" | "gelu_tanh"
    qkv_bias: bool
    partial_rotary: bool  # RoPE on the leading dims of a head only
    sliding_window: int | None
    logit_cap: float | None
    # mixture of experts (layers/moe/): "dense" gated MLP | "moe" routed experts | "moe_shared" routed experts
    # beside a gated shared expert (Qwen2-MoE); QK-norm over the whole
    # q / k width instead of per head (OLMoE)
    mlp: str = "dense"
    qk_norm_full: bool = False


class _AnyValue:
    """Every value: a LayerArithmetic field a kernel takes as an argument (a window, a soft-cap)."""

    def __contains__(self, value: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY_VALUE"


ANY_VALUE = _AnyValue()


class LayerArithmeticSet:
    """A set of LayerArithmetic records given field by field: the values each field may take. Every field
    must be named, so a field added to LayerArithmetic later is outside the set until someone says what
    the kernel does with it."""

    def __init__(self, **allowed: frozenset[object] | _AnyValue) -> None:
        names = [f.name for f in fields(LayerArithmetic)]
        if sorted(allowed) != sorted(names):
            raise ValueError(f"a LayerArithmeticSet names every field of LayerArithmetic {names}, "
                             f"got {sorted(allowed)}")
        self.allowed = allowed

    def outside(self, record: LayerArithmetic) -> list[str]:
        """The fields of `record` whose value is outside the set (empty: the record is in it)."""
        return [f"{name}={getattr(record, name)!r}" for name, values in self.allowed.items()
                if getattr(record, name) not in values]

    def __contains__(self, record: object) -> bool:
        return isinstance(record, LayerArithmetic) and not self.outside(record)


# What kernels/cpu/csrc/decode_stack.cpp implements: Llama, Qwen2/3, Mistral, Gemma 2/3 layers, with any
# window and attention soft-cap (paged_attention's arguments), and routed-expert MLPs (fused_experts);
# not partial rotary (Phi-3's), not a shared expert (Qwen2-MoE's), not OLMoE's full-width QK-norm.
DECODE_STACK_LAYERS = LayerArithmeticSet(
    norms=frozenset({"pre", "sandwich"}), qk_norm=frozenset({False, True}),
    activation=frozenset({"silu", "gelu_tanh"}), qkv_bias=frozenset({False, True}),
    partial_rotary=frozenset({False}), sliding_window=ANY_VALUE, logit_cap=ANY_VALUE,
    mlp=frozenset({"dense", "moe"}), qk_norm_full=frozenset({False}),
)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, ps)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ps)
        self.act = gated_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, forward_batch)), forward_batch)


class Attention(nn.Module):
    """q/k/v in one GEMM, optional per-head QK-norm, RoPE, paged attention with the layer's window and
    soft-cap, the output projection."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, ps
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, ps)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # the width each QK-norm spans: one head, or (OLMoE) this rank's whole q / k
        self.q_norm_width = self.k_norm_width = cfg.head_dim
        if cfg.qk_norm and cfg.qk_norm_full:

            self.q_norm, self.k_norm = full_width_qk_norms(self.qkv_proj, cfg.rms_norm_eps, ps)
            self.q_norm_width, self.k_norm_width = self.q_size, self.kv_size
        self.rotary_emb = rotary_emb  # shared by the layers of one RoPE base (one cos/sin gather per step)
        self.attn = RadixAttention(
            self.qkv_proj.num_heads, cfg.head_dim, cfg.scaling, self.qkv_proj.num_kv_heads, layer_id,
            sliding_window=cfg.layer_window(layer_id), logit_cap=cfg.attn_logit_softcap,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x, forward_batch)
        if self.q_norm is None:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.q_norm_width)).view(n, -1)
            k = self.k_norm(k.reshape(-1, self.k_norm_width)).view(n, -1)
            qk = torch.cat([q, k], dim=-1)
        # q and k heads are adjacent: rotate them in one pass
        qk = self.rotary_emb.rotate_heads(positions, qk.view(n, -1, self.head_dim), forward_batch.rope_rows)
        qk = qk.view(n, -1)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, forward_batch), forward_batch)


class DecoderLayer(nn.Module):
    """One block. Residuals travel beside the hidden state so each norm fuses its residual add:
        pre       x = attn(norm(x + r)); x = mlp(norm(x + r))
        sandwich  x = post_attn_norm(attn(norm(x + r))); x = post_ff_norm(mlp(pre_ff_norm(x + r)))"""

    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, ps, rotary_emb)
        self.mlp = SparseMoeBlock(cfg, layer_id, ps) if layer_id in cfg.moe_layers else GatedMLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, forward_batch)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x, forward_batch), residual
        x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x, forward_batch)), residual


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, never called."""


class DecoderModel(nn.Module):
    """Embedding -> decoder layers -> final norm (this stage's part of them)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.stage_layers = ps.stage_layers(cfg.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps) if ps.is_first_stage else None
        self.embed_scale = cfg.embed_scale
        # one RotaryEmbedding per distinct RoPE base (Gemma 3: local and global layers differ)
        ropes: dict[float, RotaryEmbedding] = {}
        for i in self.stage_layers:
            theta = cfg.layer_rope_theta(i)
            if theta not in ropes:
                scaling = cfg.rope_scaling if theta == cfg.rope_theta else None
                ropes[theta] = RotaryEmbedding(cfg.head_dim, cfg.context_len, theta, scaling, cfg.rotary_dim,
                                               cfg.trained_context_len, cfg.mrope_section)
        self.rotary_embs = nn.ModuleList(ropes.values())
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, ps, ropes[cfg.layer_rope_theta(i)]) if i in self.stage_layers else PPMissingLayer()
             for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The RoPE of a model with one RoPE base."""
        if len(self.rotary_embs) != 1:
            raise ValueError(f"this model has {len(self.rotary_embs)} RoPE bases")
        return self.rotary_embs[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [n_tokens, hidden]
        # Gemma: sqrt(hidden) rounded to the activations' dtype first, as transformers does
        return x if self.embed_scale == 1.0 else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None, input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if pp_proxy is None:  # input_embeds: a vision-language model's, image rows in (multimodal/mm_embedding.py)
            x, residual = (self.embed(input_ids) if input_embeds is None else input_embeds), None
        else:
            x, residual = pp_proxy.hidden_states, pp_proxy.residual
        for i in self.stage_layers:
            x, residual = self.layers[i](positions, x, residual, forward_batch)
        if not self.ps.is_last_stage:
            return PPProxyTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """A decoder-only language model; see the module docstring for the interface."""

    # checkpoint name fragment -> (our stacked parameter, shard id): separate q/k/v and gate/up tensors
    stacked_params: list[tuple[str, str, object]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]
    fused_checkpoint_params: tuple[str, ...] = ()  # stored fused (Phi-3): split into shards before loading
    non_text_prefixes: tuple[str, ...] = ()  # outside the text decoder (a vision tower): the subclass loads them

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.config = cfg
        self.ps = ps
        self.model = DecoderModel(cfg, ps)
        self.lm_head = self.logits_processor = self.score = None
        if cfg.num_labels:
            # a sequence classifier (model_loader/classifier_config.py): `score` [labels, hidden] replaces the LM head
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        elif ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight
            self.logits_processor = LogitsProcessor(cfg.vocab_size, ps, cfg.final_logit_softcap)

    def layer_arithmetic(self, layer_id: int) -> LayerArithmetic:
        cfg = self.config
        return LayerArithmetic(
            norms="sandwich" if cfg.sandwich_norms else "pre", qk_norm=cfg.qk_norm, activation=cfg.hidden_act,
            qkv_bias=cfg.attention_bias, partial_rotary=cfg.rotary_dim != 0,
            sliding_window=cfg.layer_window(layer_id), logit_cap=cfg.attn_logit_softcap,
            mlp=("moe_shared" if cfg.shared_expert_intermediate_size else "moe") if layer_id in cfg.moe_layers
            else "dense", qk_norm_full=cfg.qk_norm_full,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> LogitsProcessorOutput | PPProxyTensors:
        hidden = self.model(input_ids, positions, forward_batch, pp_proxy)
        if isinstance(hidden, PPProxyTensors):
            return hidden
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def holds_checkpoint_tensor(self, name: str) -> bool:
        """Whether this pipeline stage needs checkpoint tensor `name` (the loaders skip the others without
        reading or dequantising them). Names outside the model's layout are kept, so load_weights still
        refuses them."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is not None:
            return int(m.group(1)) in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            tied_head = self.config.tie_word_embeddings and self.lm_head is not None
            return self.model.embed_tokens is not None or tied_head
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith(("lm_head.", "score.")):  # the head this model has (a classifier's: score)
            return getattr(self, name.split(".", 1)[0]) is not None
        return True

    def checkpoint_sources(self, module_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors stacked into the weight of `module_name`, in row order (q, k, v for
        qkv_proj; gate, up for gate_up_proj), each with its shard id: what a low-bit copy is built from."""
        if module_name == "lm_head":
            return [("model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight", None)]
        name = module_name + "."
        if any(fused in name for fused in self.fused_checkpoint_params):
            return [(module_name + ".weight", None)]
        parts = [(name.replace(ours, ckpt) + "weight", sid) for ckpt, ours, sid in self.stacked_params if ours in name]
        return parts or [(module_name + ".weight", None)]

    def _split_fused(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """A fused q/k/v or gate/up checkpoint tensor as its shards, each loaded by the layer's own TP rule."""
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            sizes, sids = [q, kv, kv], ["q", "k", "v"]
        else:
            sizes, sids = [cfg.intermediate_size] * 2, [0, 1]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name}: fused checkpoint tensor has {tensor.shape[0]} rows, expected {sum(sizes)}")
        for part, sid in zip(tensor.split(sizes, dim=0), sids):
            yield name, part, sid

    def _checkpoint_entries(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """(our parameter name, tensor, shard id) for one checkpoint tensor."""
        if any(fused in name for fused in self.fused_checkpoint_params):
            yield from self._split_fused(name, tensor)
            return
        for ckpt, ours, sid in self.stacked_params:
            if ckpt in name:
                yield name.replace(ckpt, ours), tensor, sid
                return
        yield name, tensor, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {n: p for n, p in self.named_parameters(remove_duplicate=False) if not n.startswith(self.non_text_prefixes)}
        # norms whose checkpoint stores w for a layer that multiplies by (offset + w) (Gemma: 1 + w)
        norm_params = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, RMSNorm)}
        loaded: set[str] = set()
        for ckpt_name, ckpt_tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding already provides it
            if not self.holds_checkpoint_tensor(ckpt_name):
                continue  # another pipeline stage's (a loader given no filter yields everything)
            if ckpt_name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
                # tied, on a last stage without the embedding: its LM head is its own copy of the matrix
                ckpt_name = "lm_head.weight"
            for name, tensor, shard_id in self._checkpoint_entries(ckpt_name, ckpt_tensor):
                if name not in params:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}")
                if name in norm_params and self.config.norm_offset:
                    tensor = tensor + self.config.norm_offset
                self._load_one(name, params[name], tensor, shard_id)
                loaded.add(name)
        shared = self.config.tie_word_embeddings and self.model.embed_tokens is not None  # loaded as the embedding
        expected = {n for n in params if not (n == "lm_head.weight" and shared)}
        if missing := sorted(expected - loaded):
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    @staticmethod
    def _load_one(name: str, param: nn.Parameter, tensor: torch.Tensor, shard_id: object) -> None:
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            loader(param, tensor.to(param.dtype), shard_id)
