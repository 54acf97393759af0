"""RadixAttention: the model-side attention layer. It owns no KV; it names its layer, its head shape and
what its attention computes (a sliding window, a logit soft-cap) and hands q/k/v with the batch to the
step's attention backend.

    sliding_window W (None: global)  query at position p sees keys j with p - W < j <= p, as transformers
                                     (`kv_idx > q_idx - sliding_window`) and llama.cpp (n_swa) define it
    logit_cap c (None: none)         scores s = (q . k) * scaling become c * tanh(s / c) before the softmax
                                     (Gemma 2)
Every backend and kernel honours both, in every forward mode; keys outside the window are never read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
        sliding_window: int | None = None, logit_cap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logit_cap is not None and not logit_cap > 0:
            raise ValueError(f"logit_cap must be > 0 or None, got {logit_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap

    @property
    def window_arg(self) -> int:
        """The window as the C++ kernels take it: 0 = global."""
        return self.sliding_window or 0

    @property
    def cap_arg(self) -> float:
        """The soft-cap as the C++ kernels take it: 0.0 = none."""
        return float(self.logit_cap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
