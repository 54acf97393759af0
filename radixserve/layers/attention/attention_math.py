"""The PyTorch attention path's masks and math, shared by its parts (torch_native_backend.py): which keys a query
sees (causal, sliding window, an image span seen both ways), the windowed slot tables, SDPA with or without a
logit soft-cap, and the gather of slots from the paged pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.mem_cache.kv_quant import dequantize_kv


def window_start(pos: int, window: int | None) -> int:
    """The first key a query at position pos sees."""
    return 0 if window is None else max(0, pos - window + 1)


def effective_window(window: int | None, n_keys: int) -> int | None:
    """None where the window hides nothing: every query of a part whose positions are < n_keys sees all its
    keys, so the global view (and its SDPA fast paths) computes the same."""
    return None if window is None or window >= n_keys else window


def band_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None,
          q_last: torch.Tensor | None = None) -> torch.Tensor:
    """[..., Lq, Lk] bool, True = attend, from q_pos [..., Lq] and key_pos [..., Lk] (broadcast): key j is
    visible to query i iff j <= i (j <= q_last[i] where given: an image span seen both ways), and, with a window
    W, j > i - W (transformers' sliding-window rule, applied after: AND(window, OR(causal, span)))."""
    qp, kp = q_pos.unsqueeze(-1), key_pos.unsqueeze(-2)
    mask = kp <= (qp if q_last is None else q_last.unsqueeze(-1))
    if window is not None:
        mask &= kp > qp - window
    return mask


def windowed_table(kv_indices: torch.Tensor, q_pos: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched part's slot table cut to the keys a window lets its rows see: request b's columns start at
    its first row's window start, width = window + L - 1 (the span of L consecutive windows), so a step reads
    O(window) keys per request however long its history. Returns (table [nb, width], mask [nb, 1, L, width]).
    Columns past the table (short histories) repeat its last entry, masked out."""
    max_len, q_len = kv_indices.shape[1], q_pos.shape[1]
    width = min(max_len, window + q_len - 1)
    first = (q_pos.min(dim=1, keepdim=True).values - window + 1).clamp(min=0)  # [nb, 1]
    key_pos = first + torch.arange(width, device=kv_indices.device)  # [nb, width]
    table = kv_indices.gather(1, key_pos.clamp(max=max_len - 1)).contiguous()
    return table, band_mask(q_pos, key_pos, window).unsqueeze(1)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float | None
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask (True = attend) broadcast to [B, H, Lq, Lk]."""
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return capped_attention(q, k, v, mask, scale, cap)


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with a logit soft-cap (SDPA has none): scores, cap * tanh(s / cap), mask, softmax, in
    float32 whatever the model dtype. Every row sees at least its own key, so no row is all -inf."""
    group = q.shape[-3] // k.shape[-3]
    kf = k.float().repeat_interleave(group, dim=-3)
    vf = v.float().repeat_interleave(group, dim=-3)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vf).to(q.dtype)


def gather_kv(buf: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf[indices] for slot tables of any shape, in the queries' dtype (a bf16 KV cache is widened
    here). index_select on the flattened table is a row memcpy; advanced indexing is ~2.7x slower on
    CPU (measured: 1.4 vs 3.7 GB/s)."""
    # [*idx_shape] -> [*idx_shape, kv_heads, head_dim]
    rows = buf.index_select(0, indices.reshape(-1)).view(*indices.shape, *buf.shape[1:])
    return dequantize_kv(rows, dtype)  # a quantised pool: only the rows this step reads are widened (kv_quant.py)
