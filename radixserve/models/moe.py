"""Mixture-of-experts decoders: the shared decoder layer (models/base.py) with a SparseMoeBlock
(layers/moe/) as the MLP of its sparse layers. What they differ in is ModelConfig data (moe_config.py):

    Qwen3-MoE   per-head QK-norm, softmax top-k (renormalised in the released configs), optional dense
                layers (decoder_sparse_step, mlp_only_layers)
    Qwen2-MoE   q/k/v bias, a sigmoid-gated shared expert, no renormalisation
    OLMoE       QK-norm over the whole q / k width, no renormalisation
    Mixtral     the Llama block, top-2 renormalised, `block_sparse_moe.experts.{e}.w1/w3/w2` tensors

The class here maps the checkpoints' expert tensors (one per expert and projection, or stacked 3-D from a
GGUF / transformers 5) onto the stacked FusedMoE weights and refuses a checkpoint lacking one, naming it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.moe import ExpertLoad, SparseMoeBlock
from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.base import CausalLM

# checkpoint projection name -> FusedMoE part (HF Qwen/OLMoE names, Mixtral's w1/w3/w2)
_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down",
          "gate_up_proj": "gate_up"}
_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# stacked: transformers 5's fused `experts.gate_up_proj` / `experts.down_proj` (no suffix) and the GGUF
# loader's `experts.{gate,up,down}_proj.weight` ([experts, out, in])
_STACKED = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(\.weight)?")


class MoECausalLM(CausalLM):
    # how the architecture's HF checkpoints name one expert's projections (for error messages)
    expert_names: ClassVar[dict[str, str]] = {"gate": "mlp.experts.{e}.gate_proj", "up": "mlp.experts.{e}.up_proj",
                    "down": "mlp.experts.{e}.down_proj"}

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps)
        self.expert_load = ExpertLoad(cfg.num_experts)
        for block in self.moe_blocks():
            block.expert_load = self.expert_load

    def moe_blocks(self) -> Iterator[SparseMoeBlock]:
        for i in self.model.stage_layers:
            mlp = self.model.layers[i].mlp
            if isinstance(mlp, SparseMoeBlock):
                yield mlp

    def _checkpoint_entries(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        m = _PER_EXPERT.fullmatch(name)
        if m is not None and m.group(3) in _PARTS:
            prefix, expert, part = m.group(1), int(m.group(2)), _PARTS[m.group(3)]
            yield f"{prefix}.mlp.experts.{'w2' if part == 'down' else 'w13'}", tensor, (expert, part)
            return
        m = _STACKED.fullmatch(name)
        if m is not None:
            part = _PARTS[m.group(2)]
            yield f"{m.group(1)}.mlp.experts.{'w2' if part == 'down' else 'w13'}", tensor, (None, part)
            return
        if ".block_sparse_moe.gate." in name:  # Mixtral's router
            name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        if name.endswith(".mlp.shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor.unsqueeze(0)  # GGUF stores the shared expert's gate as a vector
        yield from super()._checkpoint_entries(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for block in self.moe_blocks():
            missing = block.experts.missing()
            if missing:
                e, part = missing[0]
                name = f"model.layers.{block.layer_id}.{self.expert_names[part].format(e=e)}.weight"
                more = f" and {len(missing) - 1} more expert tensors" if len(missing) > 1 else ""
                raise ValueError(f"weights missing from the checkpoint: {name!r}{more}")


class Qwen3MoeForCausalLM(MoECausalLM):
    pass


class Qwen2MoeForCausalLM(MoECausalLM):
    pass


class OlmoeForCausalLM(MoECausalLM):
    pass


class MixtralForCausalLM(MoECausalLM):
    expert_names: ClassVar[dict[str, str]] = {"gate": "block_sparse_moe.experts.{e}.w1", "up": "block_sparse_moe.experts.{e}.w3",
                    "down": "block_sparse_moe.experts.{e}.w2"}
