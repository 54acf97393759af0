"""The attention backend interface.

Invariants every backend keeps:
- init_forward_metadata(forward_batch) is called once per step, before the model runs; whatever
  it derives (KV index tables, masks) is shared by all layers via forward_batch.attn_metadata.
- forward() first writes this step's K/V at forward_batch.out_cache_loc (never elsewhere: the
  scheduler chose those slots), then attends. It never allocates or frees slots.
- The output has one row per query token, in input order: [n_tokens, num_heads * head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q [n, num_heads * head_dim], k/v [n, num_kv_heads * head_dim] -> [n, num_heads * head_dim]."""
        n = q.shape[0]
        q = q.view(n, layer.num_heads, layer.head_dim)
        k = k.view(n, layer.num_kv_heads, layer.head_dim)
        v = v.view(n, layer.num_kv_heads, layer.head_dim)
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self.attend(q, k, v, layer, forward_batch).reshape(n, layer.num_heads * layer.head_dim)

    # One entry for every forward mode, not one per mode: each backend picks its paths per request
    # from the metadata init_forward_metadata derived (MIXED holds decodes and prefills in one step).
    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q [n, num_heads, head_dim], k/v [n, num_kv_heads, head_dim] (already in the pool) -> like q."""
