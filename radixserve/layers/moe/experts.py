"""FusedMoE: the routed experts' weights of one layer, stacked, and how checkpoint tensors fill them.

    w13 [experts, 2 * inter / tp, hidden]   each expert's gate rows then up rows (act() splits them)
    w2  [experts, hidden, inter / tp]       each expert's down projection

Expert parallelism (--ep-size, ParallelState.ep_size) gives each of ep_size groups of the TP ranks a
contiguous slice of whole experts (global ids expert_offset .. + num_local); within a group the remaining
tp_size / ep_size ranks cut every expert's intermediate dimension like the dense MLP's (column-parallel
gate / up, row-parallel down). Every rank holds the step's whole hidden states (attention all-reduced
them), so "dispatch" is each rank taking the pairs routed to its experts, and "combine" is the one
all-reduce over the TP group that sums the ranks' partial outputs (SparseMoeBlock).

The low-bit copy (`low_bit`: ExpertQuantWeight for gate_up and down, set by layers/quantization/plan.py
from the GGUF's own blocks or --quantization int8/int4) is what csrc/fused_experts.cpp multiplies; the
float w13 / w2 are then released where every step runs low-bit, as the dense projections' are.

Checkpoints store the experts either one tensor per expert and projection (HF's original format:
`experts.{e}.gate_proj.weight` [inter, hidden], `w1/w3/w2` for Mixtral) or stacked 3-D (GGUF's
`ffn_{gate,up,down}_exps` [experts, ...], transformers 5's `experts.gate_up_proj`); the shard id says
which (expert id or None for all, and the projection). Every (expert, projection) loaded is recorded, so
a checkpoint that lacks one is refused naming it rather than serving zeros."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.linear import LowBitHolder
from radixserve.layers.quantization.qweight import ExpertQuantWeight, QuantRows

PARTS = ("gate", "up", "down")


class FusedMoE(LowBitHolder):
    w13: nn.Parameter | None
    w2: nn.Parameter | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ps: ParallelState) -> None:
        super().__init__()
        if num_experts % ps.ep_size:
            raise ValueError(f"the model's {num_experts} experts are not divisible by ep_size ({ps.ep_size})")
        if intermediate_size % ps.moe_tp_size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) is not divisible by tp_size / ep_size "
                             f"({ps.tp_size} / {ps.ep_size})")
        self.ps = ps
        self.num_experts = num_experts  # global: the router's width
        self.num_local = num_experts // ps.ep_size
        self.expert_offset = ps.ep_rank * self.num_local
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.inter_per_rank = intermediate_size // ps.moe_tp_size
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_per_rank, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter_per_rank), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.loaded: set[tuple[int, str]] = set()
        self.low_bit: tuple[ExpertQuantWeight, ExpertQuantWeight] | None = None  # (gate_up, down)

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
            for e in range(self.num_local):
                self._load_expert(e, part, loaded[self.expert_offset + e])
            return
        if not 0 <= int(expert) < self.num_experts:
            raise ValueError(f"expert {expert} is outside the model's {self.num_experts} experts")
        if self.is_local(int(expert)):  # another expert-parallel rank's expert: not held here
            self._load_expert(int(expert) - self.expert_offset, part, loaded)

    def is_local(self, expert: int) -> bool:
        return self.expert_offset <= expert < self.expert_offset + self.num_local

    def _load_expert(self, e: int, part: str, w: torch.Tensor) -> None:
        """Local expert e's projection `part` from the full checkpoint tensor (this rank's rows / columns)."""
        inter, hidden, n = self.intermediate_size, self.hidden_size, self.inter_per_rank
        assert self.w13 is not None and self.w2 is not None, "weights load before the float copy is released"
        if part == "gate_up":
            self._check(f"expert {e} gate_up", w.shape, (2 * inter, hidden))
            self._load_expert(e, "gate", w[:inter])
            self._load_expert(e, "up", w[inter:])
            return
        if part in ("gate", "up"):
            self._check(f"expert {e} {part}", w.shape, (inter, hidden))
            offset = 0 if part == "gate" else n
            self.w13.data[e, offset : offset + n].copy_(w.narrow(*self._shard(part)))
        elif part == "down":
            self._check(f"expert {e} down", w.shape, (hidden, inter))
            self.w2.data[e].copy_(w.narrow(*self._shard(part)))
        else:
            raise ValueError(f"unknown expert projection {part!r}")
        self.loaded.add((e, part))

    def _shard(self, part: str) -> tuple[int, int, int]:
        """This rank's cut of one expert's projection, as (dim, start, length) for narrow: gate / up rows, down
        columns. The float weights (_load_expert) and the low-bit rows (shard_rows) are cut by this one rule."""
        n = self.inter_per_rank
        return (0 if part in ("gate", "up") else 1), self.ps.moe_tp_rank * n, n

    def missing(self) -> list[tuple[int, str]]:
        """The (global expert, projection) pairs of this rank's experts no checkpoint tensor filled (none when the
        low-bit copy was packed straight from the file: the float weights were never meant to be loaded)."""
        if self.low_bit is not None and self.w13 is None:
            return []
        return [(self.expert_offset + e, p) for e in range(self.num_local) for p in PARTS if (e, p) not in self.loaded]

    # ------------------------------------------------------------------ the low-bit copy
    def shard_rows(self, part: str, rows: QuantRows, name: str) -> QuantRows:
        """This rank's part of one expert's low-bit rows ([inter, hidden] gate / up, [hidden, inter] down),
        cut by _shard (down's columns in whole 32-blocks)."""
        if self.ps.moe_tp_size == 1:
            return rows
        return rows.narrow(*self._shard(part), name)

    def set_low_bit(self, w13: ExpertQuantWeight, w2: ExpertQuantWeight) -> None:
        want13, want2 = (2 * self.inter_per_rank, self.hidden_size), (self.hidden_size, self.inter_per_rank)
        if (w13.num_experts, w13.n, w13.k) != (self.num_local, *want13) or \
                (w2.num_experts, w2.n, w2.k) != (self.num_local, *want2):
            raise ValueError(f"low-bit experts {w13.num_experts} x {w13.n}x{w13.k} / {w2.n}x{w2.k} do not match the "
                             f"layer's {self.num_local} x {want13[0]}x{want13[1]} / {want2[0]}x{want2[1]}")
        self.low_bit = (w13, w2)

    def has_low_bit(self) -> bool:
        return self.low_bit is not None

    def has_float(self) -> bool:
        return self.w13 is not None

    def release_float(self) -> None:
        self.w13 = self.w2 = None

    def low_bit_nbytes(self) -> int:
        return sum(w.nbytes() for w in self.low_bit) if self.low_bit is not None else 0
