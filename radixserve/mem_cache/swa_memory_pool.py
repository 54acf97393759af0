"""The hybrid sliding-window KV pool (SGLang's SWAKVPool + SWATokenToKVPoolAllocator).

A sliding-window layer reads only the last `window` tokens of a request, so keeping its KV for the
whole context wastes most of it (Gemma 3: five local layers of six). Its layers get a pool of their own,
`--swa-full-tokens-ratio` times the size of the full layers' pool, and a token's slot there is freed
once it has left every reader's window:

    KV slot (the index space: req_to_token, out_cache_loc, the radix tree)   1  2  3  4  5  6  7  8
    full layers' buffers                rows = KV slots                      k  k  k  k  k  k  k  k
    full_to_swa[slot]                   0 = no sliding-window KV             0  0  0  9  4  2  7  5
    sliding layers' buffers             rows = full_to_swa[slot]                      k  k  k  k  k

Everything above the pools keeps speaking KV slots; a local layer's reads and writes go through
full_to_swa (SWAKVPool.layer_slots / swa_table). A position whose mapping is 0 lands on the reserved
row 0: the kernels never read a key outside a layer's window, and the tree never matches a prefix
whose last window lacks it (swa_radix_cache.py), so such a read never happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import KVPool

# The local pool must hold, for one request, the window its matched prefix keeps locked and the window of
# its own newest tokens, plus a chunk to compute: anything smaller could not run a long prompt at all.
SWA_MIN_CHUNK = 64


def hybrid_swa_layers(layer_windows: list[int | None], context_len: int) -> list[int]:
    """Which layers (by index into layer_windows) a hybrid pool puts in the sliding-window pool: those whose
    window hides part of the context. A window as long as the context saves nothing."""
    return [i for i, w in enumerate(layer_windows) if w is not None and w < context_len]


def swa_min_tokens(window: int, page_size: int) -> int:
    """The smallest sliding-window pool that lets one request run (see SWA_MIN_CHUNK)."""
    return 2 * window + max(SWA_MIN_CHUNK, 2 * page_size)


class SWAKVPool(KVPool):
    """Full layers indexed by KV slot; the sliding-window layers (model-wide ids in `swa_layer_ids`) by
    full_to_swa[KV slot], in buffers of `swa_slots` rows."""

    hybrid = True

    def __init__(
        self, num_slots: int, swa_slots: int, swa_layer_ids: list[int], num_layers: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", start_layer: int = 0,
    ) -> None:
        self.swa_layer_ids = frozenset(swa_layer_ids)
        self.swa_slots = swa_slots
        rows = [swa_slots if start_layer + i in self.swa_layer_ids else num_slots for i in range(num_layers)]
        super().__init__(num_slots, num_layers, num_kv_heads, head_dim, dtype, device, start_layer, rows)
        self.full_to_swa = torch.zeros(num_slots, dtype=torch.int64, device=self.device)

    @staticmethod
    def bytes_per_full_token(num_full_layers: int, num_swa_layers: int, ratio: float, num_kv_heads: int,
                             head_dim: int, dtype: torch.dtype) -> float:
        """KV bytes one KV slot costs when the sliding layers keep `ratio` slots per full slot: what sizes the
        pool from a budget (model_runner)."""
        per_layer = KVPool.bytes_per_token(1, num_kv_heads, head_dim, dtype)
        return per_layer * (num_full_layers + ratio * num_swa_layers)

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_layer_ids

    def layer_slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        return self.swa_table(slots) if layer_id in self.swa_layer_ids else slots

    def swa_table(self, slots: torch.Tensor) -> torch.Tensor:
        """full_to_swa of a slot table of any shape, contiguous (the kernels' layout)."""
        return self.full_to_swa.index_select(0, slots.reshape(-1)).view(slots.shape)


class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """KV slots in pages, as the base allocator hands them out, and for each slot that gets a token also a
    sliding-window slot (token-granular: the local pool has no pages). A slot's sliding-window slot is freed
    with it, or earlier by free_swa once its token has left the window.

    available_size() is the smaller of the two pools' free counts, so every caller that sizes a step by it
    (decode, retraction, speculative verify) makes room in both; the tree evicts from each as needed."""

    def __init__(self, size: int, swa_size: int, page_size: int, window: int, full_to_swa: torch.Tensor,
                 device: str | torch.device = "cpu") -> None:
        if swa_size < 2:
            raise ValueError(f"a sliding-window pool of {swa_size} slots holds no token")
        self.swa_size = swa_size  # slots, including the reserved row 0
        self.swa_window = window
        self.full_to_swa = full_to_swa
        super().__init__(size, page_size, device)  # calls clear()
        if full_to_swa.numel() < self.size:
            raise ValueError(f"full_to_swa has {full_to_swa.numel()} entries for {self.size} slots")

    def clear(self) -> None:
        super().clear()
        self.swa_free: list[int] = list(range(self.swa_size - 1, 0, -1))
        self.full_to_swa.zero_()

    @property
    def swa_total_size(self) -> int:
        return self.swa_size - 1

    def full_available_size(self) -> int:
        return super().available_size()

    def swa_available_size(self) -> int:
        return len(self.swa_free)

    def available_size(self) -> int:
        return min(super().available_size(), len(self.swa_free))

    # ------------------------------------------------------------------ alloc
    def slots_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """New pages of KV slots, or a sliding-window slot per new token (a partial page's next token takes no
        page but a local slot), whichever is more: available_size() counts both."""
        return max(super().slots_needed(prefix_lens, seq_lens), sum(s - p for p, s in zip(prefix_lens, seq_lens)))

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens > len(self.swa_free):
            return None
        return self._with_swa(super().alloc(num_tokens))

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        # at most one sliding-window slot per new token (a continued page's slots may still hold theirs)
        if sum(s - p for p, s in zip(prefix_lens, seq_lens)) > len(self.swa_free):
            return None
        return self._with_swa(super().alloc_extend(prefix_lens, seq_lens, last_locs))

    def _with_swa(self, locs: torch.Tensor | None) -> torch.Tensor | None:
        """Give every slot in locs without a sliding-window slot one (checked available by the caller)."""
        if locs is None or locs.numel() == 0:
            return locs
        bare = locs[self.full_to_swa[locs] == 0]
        n = bare.numel()
        if n:
            taken = self.swa_free[-n:]
            del self.swa_free[len(self.swa_free) - n:]
            self.full_to_swa[bare] = torch.tensor(taken, dtype=torch.int64, device=self.full_to_swa.device)
        return locs

    # ------------------------------------------------------------------ free
    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        super().free(slots)
        ps = self.page_size
        pages = torch.unique(slots // ps)
        # the whole pages went back: so do the sliding-window slots of every slot in them
        in_pages = (pages.unsqueeze(1) * ps + torch.arange(ps, device=pages.device)).reshape(-1)
        self.free_swa(in_pages)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free the sliding-window slots of these KV slots (those that have one); the KV slots stay."""
        if slots.numel() == 0:
            return
        swa = self.full_to_swa[slots]
        held = swa != 0
        if bool(held.any()):
            self.swa_free.extend(swa[held].tolist())
            self.full_to_swa[slots[held]] = 0

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand src's sliding-window slots to dst (KV slots of the same tokens; dst has none): a tombstone takes
        over a duplicate's local KV, and the duplicate is then freed without it."""
        if bool((self.full_to_swa[dst] != 0).any()):
            raise ValueError("move_swa: a destination slot already holds sliding-window KV")
        self.full_to_swa[dst] = self.full_to_swa[src]
        self.full_to_swa[src] = 0

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per slot: whether it holds sliding-window KV."""
        return self.full_to_swa[slots] != 0

    def check_swa(self) -> None:
        """The local pool's accounting: every sliding-window slot is free or mapped from one KV slot."""
        mapped = self.full_to_swa[self.full_to_swa != 0].tolist()
        if len(set(mapped)) != len(mapped):
            raise RuntimeError("a sliding-window slot is mapped from two KV slots")
        if set(mapped) & set(self.swa_free) or len(mapped) + len(self.swa_free) != self.swa_total_size:
            raise RuntimeError(f"sliding-window pool: {len(mapped)} mapped + {len(self.swa_free)} free != "
                               f"{self.swa_total_size}")


@dataclass(frozen=True)
class SWAPlan:
    """A hybrid pool's shape: the sliding-window layers (model-wide ids of this stage's), their window (the
    longest, if they differ), and how many local slots per full slot."""

    layer_ids: tuple[int, ...]
    window: int
    ratio: float

    def swa_tokens(self, full_tokens: int, page_size: int) -> int:
        """The local pool's slots for a full pool of `full_tokens`: the ratio's share, never below what one
        request needs (swa_min_tokens) nor above the full pool."""
        return min(full_tokens, max(int(full_tokens * self.ratio), swa_min_tokens(self.window, page_size)))


def plan_swa(args: Any, layer_windows: dict[int, int | None], context_len: int) -> tuple[SWAPlan | None, str]:
    """Whether this stage's layers (id -> window) get a hybrid pool: (the plan or None, why, for the log)."""
    ids = sorted(layer_windows)
    swa = [ids[i] for i in hybrid_swa_layers([layer_windows[i] for i in ids], context_len)]
    if not swa:
        return None, "no layer has a window shorter than the context"
    if args.disable_hybrid_swa_memory:
        return None, "--disable-hybrid-swa-memory"
    if args.enable_hierarchical_cache:
        return None, "the disk tier (--enable-hierarchical-cache) stores every layer's KV of every token"
    window = max(int(layer_windows[i]) for i in swa)  # type: ignore[arg-type]
    return SWAPlan(tuple(swa), window, float(args.swa_full_tokens_ratio)), (
        f"{len(swa)} of {len(ids)} layers slide over {window} tokens: their own KV pool at "
        f"{args.swa_full_tokens_ratio} of the full pool's tokens")
