"""ExpertSlab: one MoE projection's experts packed straight into the [experts, ...] tensors ExpertQuantWeight keeps.

csrc/repack.cpp writes each expert's blocks into its row of the slab; ExpertQuantWeight.stack then finds the
experts' tensors adjacent in one slab and keeps it as it is. Before, each expert had tensors of its own and the
stack copied them all: a second write of every expert's bytes, ~2 s of an OLMoE-shaped file's start on two cores,
and one layer's experts held twice while loading.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # a new tensor of this shape and dtype


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The Empty of a tensor of its own (the repack's default)."""
    return torch.empty(shape, dtype=dtype)


class ExpertSlab:
    def __init__(self, count: int) -> None:
        self.count = count
        self.tensors: list[torch.Tensor] = []  # data, d, m: in the order a repack asks for them

    def empty_for(self, index: int) -> Empty:
        """An allocator for expert `index`'s repack: its k-th tensor is row `index` of the slab's k-th. A shape that
        differs from the first expert's (not the case for one projection) gets a tensor of its own: the stack then
        copies, as before."""
        order = itertools.count()

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            k = next(order)
            if k == len(self.tensors):
                self.tensors.append(torch.empty((self.count, *shape), dtype=dtype))
            slab = self.tensors[k]
            if tuple(slab.shape[1:]) != tuple(shape) or slab.dtype != dtype:
                return torch.empty(shape, dtype=dtype)
            return slab[index]

        return empty


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """[experts, numel]: `parts` flattened and stacked; the slab itself when they are its rows in order (no copy).
    Told by their memory, not by `_base`: a dtype view (an 8-bit kind's int8 values) is a view without one."""
    first = parts[0]
    storage = first.untyped_storage()
    numel, size = first.numel(), first.numel() * first.element_size()
    start = storage.data_ptr()
    if storage.nbytes() == len(parts) * size and all(
            p.is_contiguous() and p.dtype == first.dtype and p.numel() == numel
            and p.untyped_storage().data_ptr() == start and p.data_ptr() == start + e * size
            for e, p in enumerate(parts)):
        return torch.empty(0, dtype=first.dtype).set_(storage, 0, (len(parts), numel), (numel, 1))
    return torch.stack([p.reshape(-1) for p in parts])
