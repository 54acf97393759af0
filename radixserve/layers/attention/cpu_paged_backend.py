"""The torch-native backend with its short-query path (DECODE, TARGET_VERIFY, MIXED's decodes)
replaced by the C++ kernel of kernels/cpu/csrc/paged_attention.cpp, which reads K/V in place from the paged
pool instead of gathering a padded copy per layer. Long query blocks (PREFILL, EXTEND chunks)
stay on scaled_dot_product_attention, where the gather is small next to the attention itself.

Measured with `radixserve bench one-batch` on the 2-core dev machine, batch 32 at context 512:
the gather + SDPA path spent ~380 ms of a 700 ms decode step in attention (index_select ~265 ms,
SDPA ~112 ms); see the README's Performance section for the step with this kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.torch_native_backend import BatchedPart, TorchNativeAttnBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention


class CpuPagedAttnBackend(TorchNativeAttnBackend):
    batched_mask = False  # the kernel sees keys 0 .. seq_len - L + i from seq_lens

    def __init__(self, device: torch.device, kernel: Callable[..., None]) -> None:
        super().__init__(device)
        self.kernel = kernel

    def _attend_batched(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
        b: BatchedPart, out: torch.Tensor,
    ) -> None:
        if b.all_rows:  # pure DECODE / TARGET_VERIFY: q and out are exactly the kernel's rows
            qb = q.contiguous()
            if out.is_contiguous():
                self.kernel(qb, k_buf, v_buf, b.kv_indices, b.seq_lens, b.query_len, layer.scaling, out)
                return
            ob = torch.empty_like(qb)
            self.kernel(qb, k_buf, v_buf, b.kv_indices, b.seq_lens, b.query_len, layer.scaling, ob)
            out.copy_(ob)
            return
        qb = q.index_select(0, b.token_idx)
        ob = torch.empty_like(qb)
        self.kernel(qb, k_buf, v_buf, b.kv_indices, b.seq_lens, b.query_len, layer.scaling, ob)
        out[b.token_idx] = ob
