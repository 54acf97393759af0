"""Load a model's weights from a single GGUF file (float32 under HF names, or its blocks: GGUFBlocks). Its config
is gguf_config.py's and its tokenizer gguf_tokenizer.py's, which import no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from radixserve.layers.quantization.gguf_formats import EXACT_TYPES, SUPPORTED_TENSOR_TYPES
from radixserve.model_loader.gguf_config import gguf_hf_config, gguf_record
from radixserve.model_loader.gguf_file import GGUFFile, open_gguf, unsupported_type_message
from radixserve.model_loader.gguf_moe import required_stems
from radixserve.model_loader.gguf_names import hf_parameter_name, permuted_head_count, unpermute_rows


def iterate_gguf_weights(path: str, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` for every parameter in a GGUF file, one at a time.

    Every tensor's name and type is checked before the first is yielded, so an unsupported file fails
    fast instead of half way through a load. Quantised tensors are dequantised with gguf's reference
    code, and q/k projections are un-permuted back to HF's RoPE layout where llama.cpp permuted them.
    With `keep`, only the tensors it accepts are read. Nothing is cached on disk: a float32 copy is ~7x a
    Q4 file, and the low-bit path never asks for the projections (GGUFBlocks).
    """
    f = open_gguf(path, light=True)
    plan = _tensor_plan(f)
    if keep is not None:
        plan = [p for p in plan if keep(p[1])]
    return _stream(f, plan, gguf_record(f).norm_offset)


def _tensor_plan(f: GGUFFile) -> list[tuple[str, str, int | None]]:
    """(gguf name, HF name, heads to un-permute its rows by or None) of every parameter, each tensor's
    type checked first, so an unsupported file fails before anything is read."""
    record = gguf_record(f)
    cfg = gguf_hf_config(f)
    _check_required_tensors(f, required_stems(record.required, cfg), cfg["num_hidden_layers"])
    plan: list[tuple[str, str, int | None]] = []
    for gguf_name, tensor in f.tensors.items():
        hf_name = hf_parameter_name(gguf_name, record.block_names)
        if hf_name is None:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(unsupported_type_message(f.path, gguf_name, tensor.tensor_type))
        heads = None
        if record.permuted_qk:
            heads = permuted_head_count(gguf_name, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        plan.append((gguf_name, hf_name, heads))
    return plan


def _check_required_tensors(f: GGUFFile, stems: frozenset[str], num_layers: int) -> None:
    """Every tensor the architecture needs is in the file, before anything is read (nothing half-loaded)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    needed += [f"blk.{i}.{stem}.weight" for i in range(num_layers) for stem in sorted(stems)]
    missing = [name for name in needed if name not in f.tensors]
    if missing:
        raise ValueError(f"GGUF file {f.path} ({f.architecture}) lacks tensor {missing[0]!r}"
                         f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")


def _stream(f: GGUFFile, plan: list[tuple[str, str, int | None]], norm_offset: float = 0.0
            ) -> Iterator[tuple[str, torch.Tensor]]:
    for gguf_name, hf_name, heads in plan:
        weight = torch.from_numpy(f.dequantize(gguf_name))
        if heads is not None:
            weight = unpermute_rows(weight, heads)
        if norm_offset and gguf_name.endswith("norm.weight"):
            weight -= norm_offset  # the file stores (offset + w); HF names carry w
        yield hf_name, weight


class GGUFBlocks:
    """The parameters of a GGUF file by HF name, read from the mapped file one tensor at a time.

    Nothing is read at construction (beyond the checked tensor plan): `rows(name)` is a view of the file's
    own block rows, uint8 [out, bytes per row] ([experts, out, bytes per row] for 3-D expert tensors), copied
    only where llama.cpp permuted the rows of a q/k projection (un-permuted to HF order: a row permutation
    moves whole rows of blocks, so it is exact); `dense(name)` is one tensor dequantised to float32. The
    planner turns rows into the kernels' layout tensor by tensor, so a model is never held as float32 or
    as a second copy of the file (what issue 40 measured: an 8B file grew to 30 GiB of float32 on load).
    """

    def __init__(self, path: str) -> None:
        self.file = open_gguf(path, light=True)  # the vocabulary is the tokenizer's business
        self._plan = {hf: (gguf_name, heads) for gguf_name, hf, heads in _tensor_plan(self.file)}

    def __contains__(self, hf_name: object) -> bool:
        return hf_name in self._plan

    def qtype(self, hf_name: str) -> str:
        """The ggml type name of parameter `hf_name` (e.g. "Q4_K")."""
        return self.file.tensors[self._plan[hf_name][0]].tensor_type.name

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self.file.hf_shape(self._plan[hf_name][0])

    def exact(self, hf_name: str) -> bool:
        """Whether its blocks become a kernel kind without loss (gguf_formats.EXACT_TYPES) as a 2-D or 3-D
        matrix: what `--quantization auto` keeps packed."""
        return self.qtype(hf_name) in EXACT_TYPES and len(self.shape(hf_name)) in (2, 3)

    def rows(self, hf_name: str) -> np.ndarray:
        """The file's block rows of `hf_name` (a read-only view of the mapped file unless un-permuted)."""
        gguf_name, heads = self._plan[hf_name]
        tensor = self.file.tensors[gguf_name]
        shape = self.file.hf_shape(gguf_name)
        raw = np.asarray(tensor.data).reshape(*shape[:-1], -1)
        if heads is None:
            return raw
        return unpermute_rows(torch.from_numpy(np.array(raw)), heads).numpy()

    def dense(self, hf_name: str) -> torch.Tensor:
        """Parameter `hf_name` as float32 in HF order, as iterate_gguf_weights yields it."""
        gguf_name, heads = self._plan[hf_name]
        return next(_stream(self.file, [(gguf_name, hf_name, heads)], gguf_record(self.file).norm_offset))[1]
