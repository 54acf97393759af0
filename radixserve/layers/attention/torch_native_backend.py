"""Paged attention in plain PyTorch (scaled_dot_product_attention over gathered KV slots).

Two paths, chosen per request once per step in init_forward_metadata():

  batched  requests whose query block has the same small length L (DECODE: L = 1, the decodes
           inside a MIXED batch; TARGET_VERIFY: every verified row as a one-token query of its
           own, see _verify_rows). Their histories are gathered into one padded tensor and
           attended in one call:
               kv_indices [nb, max_len] = req_to_token[req_pool_indices, :max_len]
               mask       [nb, 1, L, max_len]: key j visible to query i iff j <= prefix_len + i
  ragged   requests with a long query block (PREFILL, EXTEND chunks). One call each, because
           padding a 2,000-token chunk to its neighbours' lengths would waste more than the loop.
           A request with no cached prefix attends only to this step's K/V (no gather at all).

The global masks and index tables are built here once and reused by all layers.

Sliding windows and logit soft-caps (RadixAttention.sliding_window / logit_cap): layers of one model
may differ in window (Gemma 2 alternates local and global layers), so the windowed views (a narrower
slot table and its band mask) are built lazily, the first time a layer with that window runs in the
step, and cached on the step's metadata keyed by window; a window that covers every key of a part is
the global view. Windowed views gather only the keys some query of the part can see, and a long
query block runs in chunks of _WINDOW_CHUNK rows, each over its own keys, so a local layer's cost
stays flat as the context grows. SDPA takes no soft-cap: a capped layer computes scores, tanh cap,
mask and softmax explicitly (capped_attention); uncapped layers keep the SDPA fast paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.attention.attention_math import (
    attention,
    band_mask,
    effective_window,
    gather_kv,
    window_start,
    windowed_table,
)
from radixserve.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.mem_cache.swa_memory_pool import SWAKVPool
    from radixserve.model_executor.forward_batch_info import ForwardBatch


# query rows per SDPA call of a long block on a windowed or soft-capped layer: each chunk reads only
# the keys its rows see (and a capped layer's explicit scores stay [heads, chunk, keys])
_WINDOW_CHUNK = 256


@dataclass
class BatchedPart:
    token_idx: torch.Tensor  # [nb * L] rows of q/out belonging to these requests, request-major
    query_len: int  # L
    kv_indices: torch.Tensor  # [nb, max_len] int64, contiguous
    mask: torch.Tensor | None  # [nb, 1, L, max_len] bool, True = attend (None: the backend reads seq_lens)
    seq_lens: torch.Tensor  # [nb] int64: KV length of each request including this step's L tokens
    all_rows: bool  # token_idx covers every row of q in order (pure DECODE / TARGET_VERIFY)
    q_pos: torch.Tensor | None = None  # [nb, L] position of each row (with mask: windowed views derive from it)
    # window -> (slot table, mask) of that window's layers, built the first time one runs this step
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)


@dataclass
class WindowChunk:
    """Query rows [row0, row1) of a ragged request (relative to its start) against the keys at positions
    [key0, key1), with mask [rows, keys] (True = attend)."""

    row0: int
    row1: int
    key0: int
    key1: int
    mask: torch.Tensor


@dataclass
class RaggedItem:
    start: int  # first token row of this request
    extend_len: int
    kv_indices: torch.Tensor | None  # [seq_len] when there is a cached prefix, else None
    mask: torch.Tensor | None  # [extend_len, seq_len] bool when there is a cached prefix (or q_last)
    prefix_len: int = 0
    q_last: torch.Tensor | None = None  # [extend_len]: each row's last visible key (ForwardBatch.attn_q_last)
    # window (None: global) -> the chunks a windowed or capped layer runs, built on first use this step
    chunks: dict[int | None, list[WindowChunk]] = field(default_factory=dict, repr=False)


@dataclass
class ExtendPart:
    """The long query blocks of a step as one table, for a kernel that takes them all in one call."""

    kv_indices: torch.Tensor  # [n, max_len] int64 slot tables
    seq_lens: torch.Tensor  # [n] int64, this step's tokens included
    q_start: torch.Tensor  # [n] int64 first row in q
    q_lens: torch.Tensor  # [n] int64
    q_last: torch.Tensor | None = None  # [every row of q] int64: ForwardBatch.attn_q_last


@dataclass
class TorchNativeMetadata:
    batched: BatchedPart | None
    ragged: list[RaggedItem]
    extend: ExtendPart | None = None  # set instead of `ragged` by backends with a one-call extend kernel
    # a hybrid pool's sliding-window layers: the same step with its slot tables through full_to_swa, built the
    # first time such a layer runs (mem_cache/swa_memory_pool.py)
    swa: TorchNativeMetadata | None = field(default=None, repr=False)

    def for_swa(self, pool: SWAKVPool) -> TorchNativeMetadata:
        if self.swa is None:
            b, e = self.batched, self.extend
            self.swa = TorchNativeMetadata(
                None if b is None else replace(b, kv_indices=pool.swa_table(b.kv_indices), windowed={}),
                [replace(r, kv_indices=None if r.kv_indices is None else pool.swa_table(r.kv_indices))
                 for r in self.ragged],  # chunks hold masks only: shared
                None if e is None else replace(e, kv_indices=pool.swa_table(e.kv_indices)),
            )
        return self.swa


class TorchNativeAttnBackend(AttentionBackend):
    # SDPA reads the batched part's mask; a backend whose kernel derives visibility from seq_lens
    # sets this False, and the per-step metadata skips building it
    batched_mask = True
    # a backend whose kernel takes every long query block in one call (ExtendPart) sets this True
    extend_in_one_call = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ------------------------------------------------------------ metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        mode = fb.forward_mode
        ext = fb.extend_seq_lens_cpu
        pre = fb.extend_prefix_lens_cpu
        if mode.is_idle() or fb.batch_size == 0:
            fb.attn_metadata = TorchNativeMetadata(None, [])
            return
        if mode.is_target_verify():
            fb.attn_metadata = TorchNativeMetadata(self._verify_rows(fb), [])
            return
        if mode.is_decode():
            batched_rows = list(range(fb.batch_size))
        elif mode.is_mixed() and fb.num_extend_reqs is not None:
            batched_rows = list(range(fb.num_extend_reqs, fb.batch_size))  # the decodes
        elif mode.is_mixed():
            batched_rows = [i for i, e in enumerate(ext) if e == 1 and pre[i] > 0]
        else:
            batched_rows = []
        starts = fb.extend_start_loc.tolist() if not mode.is_decode() else list(range(fb.batch_size))
        batched = self._batched_part(fb, batched_rows, starts) if batched_rows else None
        in_batched = set(batched_rows)
        rest = [i for i in range(fb.batch_size) if i not in in_batched]
        if self.extend_in_one_call:
            extend = self._extend_part(fb, rest, starts) if rest else None
            fb.attn_metadata = TorchNativeMetadata(batched, [], extend)
            return
        ragged = [self._ragged_item(fb, i, starts[i]) for i in rest]
        fb.attn_metadata = TorchNativeMetadata(batched, ragged)

    def _extend_part(self, fb: ForwardBatch, rows: list[int], starts: list[int]) -> ExtendPart:
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        max_len = max(fb.seq_lens_cpu[i] for i in rows)
        kv = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[rows_t], :max_len].contiguous()
        return ExtendPart(kv, fb.seq_lens[rows_t].contiguous(),
                          torch.tensor([starts[i] for i in rows], dtype=torch.int64, device=self.device),
                          torch.tensor([fb.extend_seq_lens_cpu[i] for i in rows], dtype=torch.int64,
                                       device=self.device), fb.attn_q_last)

    def _batched_part(self, fb: ForwardBatch, rows: list[int], starts: list[int]) -> BatchedPart:
        lens = {fb.extend_seq_lens_cpu[i] for i in rows}
        if len(lens) != 1:
            raise ValueError(f"batched attention needs one query length per step, got {sorted(lens)}")
        q_len = lens.pop()
        max_len = max(fb.seq_lens_cpu[i] for i in rows)
        rtt = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode() and not self.batched_mask:
            # every row in order, one query each, no mask: what a batch-1 decode step needs, with no index tensors
            kv_indices = rtt[fb.req_pool_indices, :max_len]
            return BatchedPart(torch.arange(fb.batch_size, device=self.device), 1, kv_indices, None, fb.seq_lens,
                               True)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        seq_lens = fb.seq_lens[rows_t]  # [nb]
        kv_indices = rtt[fb.req_pool_indices[rows_t], :max_len].contiguous()
        mask = q_pos = None
        if self.batched_mask:
            # query i of a request sits at position prefix_len + i = seq_len - L + i
            q_pos = (seq_lens - q_len).unsqueeze(1) + torch.arange(q_len, device=self.device)  # [nb, L]
            mask = band_mask(q_pos, torch.arange(max_len, device=self.device), None).unsqueeze(1)  # [nb, 1, L, max_len]
        token_idx = (torch.tensor([starts[i] for i in rows], device=self.device).unsqueeze(1)
                     + torch.arange(q_len, device=self.device)).reshape(-1)
        all_rows = len(rows) * q_len == fb.input_ids.shape[0] and starts[rows[0]] == 0 and all(
            starts[r] == j * q_len for j, r in enumerate(rows)
        )
        return BatchedPart(token_idx, q_len, kv_indices, mask, seq_lens.contiguous(), all_rows, q_pos)

    def _verify_rows(self, fb: ForwardBatch) -> BatchedPart:
        """TARGET_VERIFY: requests verify different numbers of drafts (0 .. k), so their query blocks differ
        in length; row j of a request sees keys 0 .. prefix_len + j of its KV row (its history, the drafts
        before it, itself: all written before attention).

        A kernel that reads visibility from seq_lens (batched_mask False: cpu_paged) gets every row as a
        one-token query of its own, which is exactly the DECODE step plain decoding runs at that position:

            request A (2 drafts)  rows a0 a1 a2  ->  3 queries on A's slot row, seq_lens p+1 p+2 p+3
            request B (0 drafts)  row  b0        ->  1 query on B's slot row,  seq_len  q+1

        SDPA gets one block per request, padded to the longest: a pad repeats its request's last row (same
        query, same keys), so the duplicate outputs it scatters are that row's own. The history is gathered
        once per request, not once per row."""
        bs, n = fb.batch_size, fb.input_ids.shape[0]
        max_len = max(fb.seq_lens_cpu)
        rtt = fb.req_to_token_pool.req_to_token
        key_pos = torch.arange(max_len, device=self.device)
        if not self.batched_mask:
            req_of_row = torch.repeat_interleave(torch.arange(bs, device=self.device), fb.extend_seq_lens)  # [n]
            seq_lens = (fb.positions + 1).contiguous()  # [n] keys each row sees
            kv_indices = rtt[fb.req_pool_indices[req_of_row], :max_len].contiguous()  # [n, max_len]
            return BatchedPart(torch.arange(n, device=self.device), 1, kv_indices, None, seq_lens, True)
        q_len = max(fb.extend_seq_lens_cpu)
        j = torch.minimum(torch.arange(q_len, device=self.device).unsqueeze(0),
                          (fb.extend_seq_lens - 1).unsqueeze(1))  # [bs, L] row of the block (pads: the last)
        token_idx = (fb.extend_start_loc.unsqueeze(1) + j).reshape(-1)  # [bs * L]
        q_pos = fb.extend_prefix_lens.unsqueeze(1) + j  # [bs, L]
        mask = band_mask(q_pos, key_pos, None).unsqueeze(1)  # [bs, 1, L, max_len]
        kv_indices = rtt[fb.req_pool_indices, :max_len].contiguous()  # [bs, max_len]
        all_rows = q_len * bs == n
        return BatchedPart(token_idx, q_len, kv_indices, mask, fb.seq_lens.contiguous(), all_rows, q_pos)

    def _ragged_item(self, fb: ForwardBatch, i: int, start: int) -> RaggedItem:
        ext, pre = fb.extend_seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        last = None if fb.attn_q_last is None else fb.attn_q_last[start : start + ext]
        q_pos = pre + torch.arange(ext, device=self.device)
        if last is not None and torch.equal(last, q_pos):
            last = None  # no row of this request sees past itself: the causal paths
        if pre == 0:  # this step's own K/V only; an explicit mask where rows see past themselves
            mask = None if last is None else band_mask(q_pos, q_pos, None, last)
            return RaggedItem(start, ext, None, mask, q_last=last)
        seq = pre + ext
        kv_indices = fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[i]), :seq]
        mask = band_mask(q_pos, torch.arange(seq, device=self.device), None, last)  # [ext, seq]
        return RaggedItem(start, ext, kv_indices, mask, pre, q_last=last)

    # ------------------------------------------------------------ compute
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        md: TorchNativeMetadata = fb.attn_metadata
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if pool.is_swa_layer(layer.layer_id):
            md = md.for_swa(pool)
        out = torch.empty_like(q)  # [n, num_heads, head_dim]
        if md.batched is not None:
            self._attend_batched(q, k_buf, v_buf, layer, md.batched, out)
        if md.extend is not None:
            self._attend_extend(q, k_buf, v_buf, layer, md.extend, out)
        for item in md.ragged:
            self._attend_ragged(q, k, v, k_buf, v_buf, layer, item, out)
        return out

    def _attend_ragged(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
        layer: RadixAttention, item: RaggedItem, out: torch.Tensor,
    ) -> None:
        """Rows of one long query block against this step's own K/V (PREFILL) or its gathered history."""
        sl = slice(item.start, item.start + item.extend_len)
        window = effective_window(layer.sliding_window, item.prefix_len + item.extend_len)
        if window is not None or layer.logit_cap is not None:
            self._attend_ragged_chunks(q, k, v, k_buf, v_buf, layer, item, window, out)
            return
        qi = q[sl].transpose(0, 1).unsqueeze(0)  # [1, heads, ext, head_dim]
        if item.kv_indices is None:
            # PREFILL fast path: no history, attend causally (or by the mask) over this step's tokens only
            ki = k[sl].transpose(0, 1).unsqueeze(0)
            vi = v[sl].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=item.mask is None, attn_mask=item.mask,
                                                scale=layer.scaling, enable_gqa=True)
        else:
            ki = gather_kv(k_buf, item.kv_indices, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq, hd]
            vi = gather_kv(v_buf, item.kv_indices, q.dtype).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=item.mask, scale=layer.scaling, enable_gqa=True)
        out[sl] = oi.squeeze(0).transpose(0, 1)

    def _attend_ragged_chunks(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
        layer: RadixAttention, item: RaggedItem, window: int | None, out: torch.Tensor,
    ) -> None:
        """A windowed or capped layer: the block in row chunks, each over only the keys its rows see. The
        keys any row sees (from the first row's window start) are gathered once for all chunks."""
        chunks = item.chunks.get(window)
        if chunks is None:
            chunks = item.chunks[window] = self._ragged_chunks(item, window)
        first = chunks[0].key0  # window starts grow with the rows: the first chunk's is the lowest
        if item.kv_indices is None:  # PREFILL: the key at position p is this step's row start + p
            own = slice(item.start + first, item.start + item.extend_len)
            ki, vi = k[own], v[own]
        else:
            ki = gather_kv(k_buf, item.kv_indices[first:], q.dtype)
            vi = gather_kv(v_buf, item.kv_indices[first:], q.dtype)
        ki, vi = ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, keys, hd]
        for c in chunks:
            rows = slice(item.start + c.row0, item.start + c.row1)
            keys = slice(c.key0 - first, c.key1 - first)
            qc = q[rows].transpose(0, 1).unsqueeze(0)
            oc = attention(qc, ki[:, :, keys], vi[:, :, keys], c.mask, layer.scaling, layer.logit_cap)
            out[rows] = oc.squeeze(0).transpose(0, 1)

    def _ragged_chunks(self, item: RaggedItem, window: int | None) -> list[WindowChunk]:
        pre, ext, last = item.prefix_len, item.extend_len, item.q_last
        chunks = []
        for row0 in range(0, ext, _WINDOW_CHUNK):
            row1 = min(ext, row0 + _WINDOW_CHUNK)
            # rows' last keys never decrease: the chunk's last row sees furthest
            key0, key1 = window_start(pre + row0, window), (pre + row1 if last is None else int(last[row1 - 1]) + 1)
            q_pos = pre + torch.arange(row0, row1, device=self.device)
            rows_last = None if last is None else last[row0:row1]
            mask = band_mask(q_pos, torch.arange(key0, key1, device=self.device), window, rows_last)  # [rows, keys]
            chunks.append(WindowChunk(row0, row1, key0, key1, mask))
        return chunks

    def _attend_extend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
        e: ExtendPart, out: torch.Tensor,
    ) -> None:
        raise NotImplementedError("a backend that sets extend_in_one_call implements _attend_extend")

    def _attend_batched(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
        b: BatchedPart, out: torch.Tensor,
    ) -> None:
        """Rows b.token_idx of `out` = attention of the short query blocks over their gathered history."""
        nb = b.kv_indices.shape[0]
        qb = q[b.token_idx].view(nb, b.query_len, layer.num_heads, layer.head_dim).transpose(1, 2)
        kv_indices, mask = self._batched_view(b, layer.sliding_window)
        kb = gather_kv(k_buf, kv_indices, q.dtype).transpose(1, 2)  # [nb, kv_heads, keys, head_dim]
        vb = gather_kv(v_buf, kv_indices, q.dtype).transpose(1, 2)
        ob = attention(qb, kb, vb, mask, layer.scaling, layer.logit_cap)
        out[b.token_idx] = ob.transpose(1, 2).reshape(-1, layer.num_heads, layer.head_dim)

    def _batched_view(self, b: BatchedPart, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot table, mask) of the batched part for a layer with this window: the step's global ones, or
        the window's (built once per step, shared by every layer with that window)."""
        window = effective_window(window, b.kv_indices.shape[1])
        if window is None:
            return b.kv_indices, b.mask
        view = b.windowed.get(window)
        if view is None:
            view = b.windowed[window] = windowed_table(b.kv_indices, b.q_pos, window)
        return view
