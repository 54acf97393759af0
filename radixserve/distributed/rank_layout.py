"""RankLayout: which process does what in a tp_size x pp_size replica spread over nnodes machines.

Ranks are numbered like SGLang's: tensor-parallel ranks are the fastest-moving index inside a pipeline
stage, and nodes hold consecutive ranks, so the TP group of a stage (the one that all-reduces every
layer) stays on one machine whenever tp_size divides the ranks per node:

    rank = pp_rank * tp_size + tp_rank            tp 2 x pp 2 over 2 nodes:
    node = rank // (world_size // nnodes)            node 0: rank 0 (pp 0, tp 0), rank 1 (pp 0, tp 1)
                                                     node 1: rank 2 (pp 1, tp 0), rank 3 (pp 1, tp 1)

Pure arithmetic (no torch.distributed): the launcher uses it to start and name ranks, the ranks to
join their groups, the model to know its layers. `check_model_fits` is the one rule for which sizes a
model accepts; the launcher calls it before any process starts, so bad sizes fail before weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.model_loader.model_config import ModelConfig


@dataclass(frozen=True)
class RankLayout:
    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_ranks(self, node_rank: int) -> range:
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)

    def local_rank(self, rank: int) -> int:
        """Index of `rank` among its node's ranks (its CUDA device there)."""
        return rank - self.node_of(rank) * self.ranks_per_node

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The TP group of one pipeline stage."""
        return [self.rank_of(pp_rank, t) for t in range(self.tp_size)]

    def pipe_ranks(self, tp_rank: int) -> list[int]:
        """The ranks holding TP shard `tp_rank` in each stage, first stage first (they send to each other)."""
        return [self.rank_of(p, tp_rank) for p in range(self.pp_size)]

    def describe(self, rank: int) -> str:
        """'rank 3 (node 1, pp stage 1, tp rank 1)': how every message names a rank."""
        parts = [f"node {self.node_of(rank)}"] if self.nnodes > 1 else []
        if self.pp_size > 1:
            parts.append(f"pp stage {self.pp_rank(rank)}")
        if self.tp_size > 1:
            parts.append(f"tp rank {self.tp_rank(rank)}")
        return f"rank {rank}" + (f" ({', '.join(parts)})" if parts else "")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The contiguous layers pipeline stage `pp_rank` holds: an even split, the first `num_layers % pp_size`
    stages taking one more (the last stage also runs the final norm and the LM head, the largest matrix
    of a small model, so it is never the one given extra layers). The one place the split is decided."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_model_fits(cfg: ModelConfig, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """ValueError naming the sizes when this model cannot be split tp_size x pp_size.

    Heads split evenly over the TP ranks (KV heads may instead be replicated when there are fewer of them
    than ranks, so tp_size must then be a multiple of them), as do the MLP's rows. The vocabulary is
    padded up to a multiple of tp_size (VocabParallelEmbedding), so it never needs to divide. Every
    pipeline stage needs at least one layer. With expert parallelism the experts split over ep_size groups
    and each expert's intermediate dimension over the tp_size / ep_size ranks of a group."""
    def divides(n: int, what: str) -> None:
        if n % tp_size:
            raise ValueError(f"{what} ({n}) is not divisible by tp_size ({tp_size})")

    divides(cfg.num_attention_heads, "attention heads")
    if cfg.num_key_value_heads >= tp_size:
        divides(cfg.num_key_value_heads, "kv heads")
    elif tp_size % cfg.num_key_value_heads:
        raise ValueError(f"tp_size ({tp_size}) is neither a divisor nor a multiple of the kv heads "
                         f"({cfg.num_key_value_heads})")
    divides(cfg.intermediate_size, "MLP intermediate size")
    if ep_size > 1 and not cfg.num_experts:
        raise ValueError(f"ep_size ({ep_size}) needs a mixture-of-experts model; this one has no experts")
    if cfg.num_experts and cfg.num_experts % ep_size:
        raise ValueError(f"the model's {cfg.num_experts} experts are not divisible by ep_size ({ep_size})")
    if cfg.num_experts and ep_size == 1:  # every expert's intermediate dimension splits like the dense MLP's
        divides(cfg.moe_intermediate_size, "expert intermediate size")
    elif cfg.num_experts and cfg.moe_intermediate_size % (tp_size // ep_size):
        raise ValueError(f"expert intermediate size ({cfg.moe_intermediate_size}) is not divisible by "
                         f"tp_size / ep_size ({tp_size} / {ep_size})")
    if cfg.shared_expert_intermediate_size:  # the shared expert is a dense MLP, cut over every TP rank
        divides(cfg.shared_expert_intermediate_size, "shared expert intermediate size")
    if pp_size > cfg.num_hidden_layers:
        raise ValueError(f"pp_size ({pp_size}) is larger than the model's {cfg.num_hidden_layers} layers "
                         "(every pipeline stage needs at least one)")
