"""Expert load: how many (token, slot) pairs each expert of each MoE layer received. The MoE layers add
their counts as they run; the scheduler takes the step's counts once per step for its step record (the
step trace, /get_server_info's steps, the dashboard) and keeps a running total per expert, summed over the
layers, for /metrics (`radixserve:moe_expert_tokens`, `radixserve:moe_load_imbalance`), so a user can see
routing skew (a hot expert, a dead one).

One accumulator per model (a module attribute, never global state): runners that share weights share it."""

from __future__ import annotations

from typing import Any

import torch


class ExpertLoad:
    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._step: dict[int, torch.Tensor] = {}  # layer id -> int64 [num_experts], since the last take()
        self.totals = torch.zeros(num_experts, dtype=torch.int64)  # every take()n step, summed over layers
        self._stacked: list[tuple[list[int], torch.Tensor]] = []  # add_layers()' blocks, since the last take()

    def add(self, layer_id: int, counts: torch.Tensor) -> None:
        c = counts[: self.num_experts].to(torch.int64).cpu()
        prev = self._step.get(layer_id)
        self._step[layer_id] = c if prev is None else prev + c

    def add_layers(self, layer_ids: list[int], counts: torch.Tensor) -> None:
        """Rows `layer_ids` of counts [layers, >= num_experts] at once: the decode stack's step, one copy
        instead of a few tensor ops per layer (~1 ms a step on a 16-layer MoE)."""
        self._stacked.append((layer_ids, counts[layer_ids, : self.num_experts].to(torch.int64)))

    def take(self) -> dict[int, list[int]]:
        """Tokens per expert of each layer since the last take() (added to the totals), and clear them."""
        out = {}
        for layer, c in sorted(self._step.items()):
            self.totals += c
            out[layer] = c.tolist()
        for layer_ids, c in self._stacked:
            self.totals += c.sum(0)
            for layer, row in zip(layer_ids, c.tolist(), strict=True):
                out[layer] = [a + b for a, b in zip(out[layer], row, strict=True)] if layer in out else row
        self._step.clear()
        self._stacked.clear()
        return dict(sorted(out.items()))

    def info(self) -> dict[str, Any]:
        """The running totals, as server_info carries them (str keys: they merge across replicas)."""
        return {"moe_expert_tokens": {str(e): int(n) for e, n in enumerate(self.totals.tolist())}}


def model_expert_load(model: Any) -> ExpertLoad | None:
    """The model's accumulator; None for a dense model."""
    return getattr(model, "expert_load", None)

