"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2): GQA, optional q/k/v bias,
tied or untied embeddings, RoPE with scaling. Tensor-parallel ready: every projection is a
column/row-parallel layer built from the ParallelState it is given. Pipeline-parallel ready: a stage
builds only its layers (ParallelState.stage_layers; the others are PPMissingLayer placeholders that keep
the checkpoint's layer numbering), the first stage the embedding, the last the final norm and LM head.

forward(input_ids, positions, forward_batch, pp_proxy): the batch is passed explicitly to every layer
that needs it (attention), never read from a global. A stage after the first starts from the previous
stage's PPProxyTensors; a stage before the last returns its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.model_executor.forward_batch_info import PPProxyTensors

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_loader.model_config import ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, ps)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ps)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, ps
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, ps)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = rotary_emb  # shared by all layers (one cos/sin gather per step)
        self.attn = RadixAttention(
            self.qkv_proj.num_heads, cfg.head_dim, cfg.head_dim**-0.5, self.qkv_proj.num_kv_heads, layer_id
        )
        self.head_dim = cfg.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads are adjacent in the qkv output: rotate them in one pass
        qk = self.rotary_emb.rotate_heads(positions, qk.view(n, -1, self.head_dim)).view(n, -1)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, ps, rotary_emb)
        self.mlp = LlamaMLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.stage_layers = ps.stage_layers(cfg.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps) if ps.is_first_stage else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.context_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, i, ps, self.rotary_emb) if i in self.stage_layers else PPMissingLayer()
             for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if pp_proxy is None:
            x, residual = self.embed_tokens(input_ids), None  # [n_tokens, hidden]
        else:
            x, residual = pp_proxy.hidden_states, pp_proxy.residual
        for i in self.stage_layers:
            x, residual = self.layers[i](positions, x, residual, forward_batch)
        if not self.ps.is_last_stage:
            return PPProxyTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our stacked parameter, shard id)
    stacked_params = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.config = cfg
        self.ps = ps
        self.model = LlamaModel(cfg, ps)
        self.lm_head = self.logits_processor = None
        if ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight
            self.logits_processor = LogitsProcessor(cfg.vocab_size, ps)

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
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def checkpoint_sources(self, module_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors stacked into the weight of `module_name`, in row order (q, k, v for
        qkv_proj; gate, up for gate_up_proj), each with its shard id: what a low-bit copy is built from."""
        if module_name == "lm_head":
            return [("model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight", None)]
        name = module_name + "."
        parts = [(name.replace(ours, ckpt) + "weight", sid) for ckpt, ours, sid in self.stacked_params if ours in name]
        return parts or [(module_name + ".weight", None)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding already provides it
            if not self.holds_checkpoint_tensor(name):
                continue  # another pipeline stage's (a loader given no filter yields everything)
            if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
                # tied, on a last stage without the embedding: its LM head is its own copy of the matrix
                name = "lm_head.weight"
            shard_id: object = None
            for ckpt, ours, sid in self.stacked_params:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, ours), sid
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard_id)
            loaded.add(name)
        shared = self.config.tie_word_embeddings and self.model.embed_tokens is not None  # loaded as the embedding
        expected = {n for n in params if not (n == "lm_head.weight" and shared)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
