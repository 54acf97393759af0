"""Attention for --enable-deterministic-inference: every forward mode through one C++ kernel.

The other backends pick a path per request by its query length (SDPA over a PREFILL block, a
gathered copy for a cached prefix, the paged kernel for short blocks), and SDPA's result for a row
depends on the block it sits in (its flash tiling). Here PREFILL, EXTEND, DECODE, MIXED and
TARGET_VERIFY all run `paged_attention_varlen` (kernels/cpu/csrc/paged_attention.cpp): K/V are read through the slot
table, every query row is scored, softmaxed and summed on its own, keys in position order, so a
token's output depends only on its query, its position and the K/V it sees — not on whether its
prompt ran alone, in a batch, as one PREFILL or as EXTEND chunks over a cached prefix.

The base class writes this step's K/V into the pool before attending (PREFILL included), so the
kernel reads a request's own new keys through the same slot table as its history.

    kv_indices [bs, max_len] = req_to_token[req_pool_indices, :max_len]
    request b: query rows extend_start_loc[b] .. + extend_seq_lens[b], at positions
               seq_lens[b] - extend_seq_lens[b] + i, each seeing keys 0 .. its position (the last
               layer.sliding_window of them on a local layer; scores soft-capped by layer.logit_cap)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


@dataclass
class VarlenMetadata:
    kv_indices: torch.Tensor  # [bs, max_len] int64, contiguous
    seq_lens: torch.Tensor  # [bs] int64: KV length including this step's tokens
    q_start: torch.Tensor  # [bs] int64: first query row of each request
    q_lens: torch.Tensor  # [bs] int64: query rows of each request
    swa_kv_indices: torch.Tensor | None = None  # kv_indices through a hybrid pool's full_to_swa, on first use


class BatchInvariantAttnBackend(AttentionBackend):
    def __init__(self, device: torch.device, kernel: Callable[..., None]) -> None:
        self.device = device
        self.kernel = kernel  # torch.ops.radixserve_cpu.paged_attention_varlen

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            fb.attn_metadata = None
            return
        max_len = max(fb.seq_lens_cpu)
        kv_indices = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].contiguous()
        fb.attn_metadata = VarlenMetadata(
            kv_indices,
            fb.seq_lens.contiguous(),
            fb.extend_start_loc.contiguous(),
            fb.extend_seq_lens.contiguous(),
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        q = q.contiguous()  # [n, heads, head_dim]
        out = torch.empty_like(q)
        md: VarlenMetadata | None = fb.attn_metadata
        if md is None or q.shape[0] == 0:
            return out
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        table = md.kv_indices
        if pool.is_swa_layer(layer.layer_id):  # a hybrid pool's sliding-window layer (swa_memory_pool.py)
            if md.swa_kv_indices is None:
                md.swa_kv_indices = pool.swa_table(md.kv_indices)
            table = md.swa_kv_indices
        self.kernel(q, k_buf, v_buf, table, md.seq_lens, md.q_start, md.q_lens, layer.scaling,
                    layer.window_arg, layer.cap_arg, out)
        return out
