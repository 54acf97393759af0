"""The two device-side pools every forward reads: request rows and per-layer K/V buffers.

    ReqToTokenPool.req_to_token [max_reqs, max_context_len]   row r: token position -> KV slot
    KVPool.k_buffer[layer]      [num_slots, kv_heads, head_dim] slot -> key of one token
    KVPool.v_buffer[layer]      [num_slots, kv_heads, head_dim] slot -> value of one token

NOTE: slot 0 (page 0 when page_size > 1) is never handed out by the allocator; padded entries
of out_cache_loc / req_to_token point there and read or write garbage harmlessly.
"""

from __future__ import annotations

import mmap

import torch

from radixserve.mem_cache.kv_quant import KV_FP8, kv_bytes_per_value, kv_row_width, quantize_kv


class ReqToTokenPool:
    """Rows of token-position -> KV-slot maps, one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # int64 so it can index the KV buffers directly (no cast on the decode hot path).
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        # on CPU, a numpy view of the same memory: the scheduler reads and writes single entries every step, and
        # a numpy scalar access is ~20x cheaper than a tensor one (RequestSlots)
        self.host = self.req_to_token.numpy() if self.device.type == "cpu" else None
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        """One free row, or None when every row is taken."""
        if not self.free_slots:
            return None
        return self.free_slots.pop()

    def free(self, idx: int) -> None:
        if idx in self.free_slots or not 0 <= idx < self.size:
            raise ValueError(f"ReqToTokenPool.free: row {idx} is not allocated")
        self.req_to_token[idx].zero_()
        self.free_slots.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"sequence of {end} tokens exceeds the context length {self.max_context_len}")
        self.req_to_token[idx, start:end] = slots

    def clear(self) -> None:
        self.req_to_token.zero_()
        self.free_slots = list(range(self.size))


class KVPool:
    """Per-layer K and V buffers indexed by KV slot (MHA/GQA layout).

    A pipeline stage holds only its layers [start_layer, start_layer + num_layers); layers keep their
    model-wide layer_id and the pool subtracts start_layer."""

    hybrid = False  # SWAKVPool: the sliding-window layers keep their own, smaller buffers

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        start_layer: int = 0,
        layer_slots: list[int] | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.start_layer = start_layer
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        rows = layer_slots or [num_slots] * num_layers  # per layer (SWAKVPool: the local layers' are fewer)
        # an int8 pool holds q8_0 blocks, an fp8 pool scaled rows (kv_quant.py)
        self.row_width = kv_row_width(dtype, head_dim)
        shape = (num_kv_heads, self.row_width)
        self.k_buffer = [zeroed((n, *shape), dtype, self.device) for n in rows]
        self.v_buffer = [zeroed((n, *shape), dtype, self.device) for n in rows]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return int(2 * num_layers * num_kv_heads * head_dim * kv_bytes_per_value(dtype, head_dim))

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k_buffer[i], self.v_buffer[i]

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether the layer's buffers are indexed by sliding-window slots (SWAKVPool) rather than KV slots."""
        return False

    def layer_slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows of the layer's buffers that hold these KV slots (the slots themselves here)."""
        return slots

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K/V ([n, kv_heads, head_dim]) at the slots the scheduler chose."""
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        rows = self.layer_slots(layer_id, loc)
        # a quantised pool's rows: the bits the C++ writer stores (kv_quant.py); index_copy_ has no float8 kernel,
        # so rows are copied as raw bytes whatever the dtype holds
        for buf, x in ((k_buf, k), (v_buf, v)):
            q = quantize_kv(x, self.dtype)
            if buf.dtype == KV_FP8:
                buf, q = buf.view(torch.uint8), q.view(torch.uint8)
            buf.index_copy_(0, rows, q)


_LAZY_MIN_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled buffer. On the CPU a large one is an anonymous mapping: the kernel hands out zero pages as they
    are first touched, so the pool costs no time to make (torch.zeros writes every page: ~0.2 s a GiB) and only the
    slots ever written become resident memory. The tensor keeps its mapping alive."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < _LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
