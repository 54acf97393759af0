"""KernelMode: which kernels a runner's layers run, chosen once when the runner loads.

    ModelRunner.__init__ --KernelMode(low-bit ops and row cap, batch-invariant)--> runner.kernel_mode
    ForwardBatch.init_new(mwb, runner) -----------------------------------------> forward_batch.kernel_mode
    a layer's forward(x, forward_batch) ----------------------------------------> forward_batch.kernel_mode

The mode travels with the ForwardBatch, the input every layer already gets, not on the modules: runners
may share one set of weights (a self-drafting speculative runner, tests and benchmarks that pass `model=`)
with different choices (the exact mode beside --enable-deterministic-inference, different low-bit row
caps), and each must see its own. A layer type that picks kernels (PackableLinear; a new one, e.g. fused
MoE experts with low-bit copies) reads `step_kernels(forward_batch)`: `low_bit_ops(rows)` for a step of
`rows` rows, `batch_invariant` for deterministic inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class KernelMode:
    # torch.ops.radixserve_cpu when the runner runs its low-bit weight copies (layers/quantization/);
    # None: float weights only
    low_bit: Any = None
    low_bit_max_rows: int | None = None  # steps of at most this many rows run low-bit; None = every step
    batch_invariant: bool = False  # --enable-deterministic-inference: fixed row tiles (layers/batch_invariant.py)

    def low_bit_ops(self, rows: int) -> Any:
        """The low-bit kernels' ops when a step of `rows` rows runs the low-bit copies, else None."""
        cap = self.low_bit_max_rows
        return self.low_bit if cap is None or rows <= cap else None


EXACT = KernelMode()  # the float weights, each op on its fastest path (and a call that has no ForwardBatch)


def step_kernels(forward_batch: ForwardBatch | None) -> KernelMode:
    """The kernels a layer runs for this step: its runner's KernelMode; EXACT for a call outside a step."""
    return EXACT if forward_batch is None else forward_batch.kernel_mode
