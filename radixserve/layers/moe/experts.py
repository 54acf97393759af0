"""FusedMoE: the routed experts' weights of one layer, stacked, and how checkpoint tensors fill them.

    w13 [experts, 2 * inter / tp, hidden]   each expert's gate rows then up rows (act() splits them)
    w2  [experts, hidden, inter / tp]       each expert's down projection

Tensor parallelism cuts every expert's intermediate dimension like the dense MLP's (column-parallel
gate / up, row-parallel down): each rank computes a partial sum that the layer all-reduces once.

Checkpoints store the experts either one tensor per expert and projection (HF's original format:
`experts.{e}.gate_proj.weight` [inter, hidden], `w1/w3/w2` for Mixtral) or stacked 3-D (GGUF's
`ffn_{gate,up,down}_exps` [experts, ...], transformers 5's `experts.gate_up_proj`); the shard id says
which (expert id or None for all, and the projection). Every (expert, projection) loaded is recorded, so
a checkpoint that lacks one is refused naming it rather than serving zeros."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState

PARTS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ps: ParallelState) -> None:
        super().__init__()
        if intermediate_size % ps.tp_size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) is not divisible by tp_size "
                             f"({ps.tp_size})")
        self.ps = ps
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.inter_per_rank = intermediate_size // ps.tp_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter_per_rank, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_per_rank), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.loaded: set[tuple[int, str]] = set()

    def _check(self, what: str, got: torch.Size, want: tuple[int, ...]) -> None:
        if tuple(got) != want:
            raise ValueError(f"{what}: checkpoint shape {tuple(got)} != expected {want}")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """shard_id = (expert id or None for a stacked [experts, ...] tensor, "gate" | "up" | "down" | "gate_up")."""
        expert, part = shard_id  # type: ignore[misc]
        if expert is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked {part} experts tensor has shape {tuple(loaded.shape)}; expected "
                                 f"[{self.num_experts}, ...] (the model's expert count)")
            for e in range(self.num_experts):
                self._load_expert(e, part, loaded[e])
            return
        if not 0 <= int(expert) < self.num_experts:
            raise ValueError(f"expert {expert} is outside the model's {self.num_experts} experts")
        self._load_expert(int(expert), part, loaded)

    def _load_expert(self, e: int, part: str, w: torch.Tensor) -> None:
        inter, hidden, n, r = self.intermediate_size, self.hidden_size, self.inter_per_rank, self.ps.tp_rank
        if part == "gate_up":
            self._check(f"expert {e} gate_up", w.shape, (2 * inter, hidden))
            self._load_expert(e, "gate", w[:inter])
            self._load_expert(e, "up", w[inter:])
            return
        if part in ("gate", "up"):
            self._check(f"expert {e} {part}", w.shape, (inter, hidden))
            offset = 0 if part == "gate" else n
            self.w13.data[e, offset : offset + n].copy_(w[r * n : (r + 1) * n])
        elif part == "down":
            self._check(f"expert {e} down", w.shape, (hidden, inter))
            self.w2.data[e].copy_(w[:, r * n : (r + 1) * n])
        else:
            raise ValueError(f"unknown expert projection {part!r}")
        self.loaded.add((e, part))

    def missing(self) -> list[tuple[int, str]]:
        """The (expert, projection) pairs no checkpoint tensor filled."""
        return [(e, p) for e in range(self.num_experts) for p in PARTS if (e, p) not in self.loaded]
