"""The torch-native backend with both of its paths replaced by C++ kernels that read K/V in place from
the paged pool (float32 or bf16) instead of gathering a padded copy per layer:

  short query blocks (DECODE, TARGET_VERIFY, MIXED's decodes)   kernels/cpu/csrc/paged_attention.cpp
  long query blocks (PREFILL, EXTEND chunks, MIXED's prefills)  kernels/cpu/csrc/flash_attention.cpp:
      tiled with an online softmax, every request of the step in one call, no S x S mask (SDPA needs
      one, and a gathered history, as soon as a request has a cached prefix)

Measured with `radixserve bench one-batch` on the 2-core dev machine, batch 32 at context 512:
the gather + SDPA path spent ~380 ms of a 700 ms decode step in attention (index_select ~265 ms,
SDPA ~112 ms); see the README's Performance section for the step with this kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.torch_native_backend import BatchedPart, ExtendPart, TorchNativeAttnBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class CpuPagedAttnBackend(TorchNativeAttnBackend):
    batched_mask = False  # the kernel derives each query's keys (causal, windowed) from seq_lens
    extend_in_one_call = True

    def __init__(self, device: torch.device, kernel: Callable[..., None], extend_kernel: Callable[..., None]) -> None:
        super().__init__(device)
        self.kernel = kernel
        self.extend_kernel = extend_kernel

    @staticmethod
    def whole_step_rows(fb: ForwardBatch) -> BatchedPart | None:
        """The step's paged-kernel part when it covers every row (a pure DECODE / TARGET_VERIFY step: what a
        caller running the whole step natively, CpuGraphRunner, binds to), else None."""
        md = fb.attn_metadata
        b = md.batched if md is not None else None
        return b if b is not None and b.all_rows else None

    def _attend_extend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
        e: ExtendPart, out: torch.Tensor,
    ) -> None:
        # rows of q not owned by these requests (MIXED's decodes) are left to _attend_batched
        self.extend_kernel(q.contiguous(), k_buf, v_buf, e.kv_indices, e.seq_lens, e.q_start, e.q_lens,
                           layer.scaling, layer.window_arg, layer.cap_arg, out, e.q_last)

    def _attend_batched(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
        b: BatchedPart, out: torch.Tensor,
    ) -> None:
        if b.all_rows:  # pure DECODE / TARGET_VERIFY: q and out are exactly the kernel's rows
            qb = q.contiguous()
            if out.is_contiguous():
                self._paged(qb, k_buf, v_buf, layer, b, out)
                return
            ob = torch.empty_like(qb)
            self._paged(qb, k_buf, v_buf, layer, b, ob)
            out.copy_(ob)
            return
        qb = q.index_select(0, b.token_idx)
        ob = torch.empty_like(qb)
        self._paged(qb, k_buf, v_buf, layer, b, ob)
        out[b.token_idx] = ob

    def _paged(
        self, qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, b: BatchedPart,
        ob: torch.Tensor,
    ) -> None:
        self.kernel(qb, k_buf, v_buf, b.kv_indices, b.seq_lens, b.query_len, layer.scaling, layer.window_arg,
                    layer.cap_arg, ob)
