"""One parsed GGUF file: metadata access, tensor lookup and dequantisation, cached per file.

Parsing is the expensive part of GGUF loading (gguf's reader walks every vocabulary string; ~6 s for
the 49k-token default model on a small machine), so each file is parsed once and shared by the
config, weight and tokenizer loaders.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

_MISSING = object()
_LIGHT_ARRAY_MIN = 256  # arrays longer than this are skipped unread by a light parse (open_gguf(light=True))


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its path, gguf's reader, and tensors by llama.cpp name."""

    path: str
    reader: gguf.GGUFReader
    tensors: dict[str, Any] = field(repr=False)

    @property
    def architecture(self) -> str:
        """The `general.architecture` metadata value (e.g. "llama")."""
        return str(self.get("general.architecture"))

    def has(self, key: str) -> bool:
        """Whether the metadata has `key`."""
        return key in self.reader.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value under `key` as a Python scalar, str or list.

        Raises ValueError when the key is absent and no default is given.
        """
        fld = self.reader.fields.get(key)
        if fld is None:
            if default is _MISSING:
                raise ValueError(f"GGUF file {self.path} has no metadata key {key!r}")
            return default
        return _field_value(fld)

    def array_len(self, key: str) -> int | None:
        """Length of an array-valued metadata entry without decoding it (None when absent)."""
        fld = self.reader.fields.get(key)
        if fld is None:
            return None
        if fld.types and fld.types[0] == gguf.GGUFValueType.ARRAY:
            return int(fld.parts[1][0])  # the stored length (a light parse leaves the values unread)
        return len(fld.data)

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order (ggml lists dimensions innermost-first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as a fresh, writable float32 array in PyTorch order ([out, in] for matrices)."""
        # the registry builds torch tensors; the HTTP process parses GGUF metadata only
        from radixserve.layers.quantization.gguf_formats import SUPPORTED_TENSOR_TYPES  # lazy: torch

        tensor = self.tensors[name]
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(unsupported_type_message(self.path, name, tensor.tensor_type))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # F32 comes back as a view of the read-only memmap; torch wants memory it may own and write.
        if not values.flags.writeable:
            values = values.copy()
        return values.astype(np.float32, copy=False).reshape(self.hf_shape(name))


def unsupported_type_message(path: str, name: str, qtype: QType | int) -> str:
    """The error text for a tensor whose ggml type we do not dequantise."""
    from radixserve.layers.quantization.gguf_formats import SUPPORTED_TENSOR_TYPES  # lazy: as in dequantize

    type_name = qtype.name if isinstance(qtype, QType) else f"type id {int(qtype)}"
    supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
    return f"GGUF tensor {name!r} in {path} has unsupported type {type_name} (supported: {supported})"


def open_gguf(path: str, light: bool = False) -> GGUFFile:
    """Parse (or fetch from the cache) the GGUF file at `path`.

    The cache key includes the file's size and mtime so a file rewritten in place is re-read. `light`: the
    tensors and the short metadata only, long arrays (the vocabulary) stepped over unread (what loading the
    weights needs: milliseconds and a few MB where the full parse of a 49k-token vocabulary takes seconds and ~150 MB).
    Raises ValueError when the file is truncated, corrupt or not GGUF at all.
    """
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    return _open_cached(real, stat.st_mtime_ns, stat.st_size, light)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int, light: bool = False) -> GGUFFile:
    del mtime_ns  # only part of the cache key
    bad_file = f"{path} is truncated or not a GGUF file"
    try:
        reader = _CheckedReader(path, light)
    except _BadTensor as exc:
        raise ValueError(f"{path} is corrupt: {exc}") from exc
    except _ShortTensor as exc:
        raise ValueError(f"{bad_file}: {exc}") from exc
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors depending on where it stops
        raise ValueError(f"{bad_file} ({type(exc).__name__}: {exc})") from exc
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        # gguf's reader already fails to reshape a short tensor; this also catches a file cut exactly
        # at a tensor boundary, and says which tensor is short.
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{bad_file}: tensor {tensor.name!r} ({tensor.tensor_type.name}) extends past the "
                             "end of the file")
        tensors[tensor.name] = tensor
    # a tensor's bytes follow from its shape and type; more than its slot holds (up to the next tensor)
    # means the shape or the type id is wrong, and its values would be another tensor's bytes
    by_offset = sorted(reader.tensors, key=lambda t: int(t.data_offset))
    for t, nxt in itertools.pairwise(by_offset):
        if int(t.data_offset) + int(t.n_bytes) > int(nxt.data_offset):
            raise ValueError(f"{path} is corrupt: tensor {t.name!r} ({t.tensor_type.name}, shape "
                             f"{list(reversed(t.shape.tolist()))}) needs {int(t.n_bytes)} bytes but only "
                             f"{int(nxt.data_offset) - int(t.data_offset)} lie before the next tensor "
                             f"{nxt.name!r}")
    return GGUFFile(path=path, reader=reader, tensors=tensors)


class _ShortTensor(ValueError):
    """A tensor whose bytes run past the end of the file: a truncated file."""


class _BadTensor(ValueError):
    """A tensor record that names no ggml type, or a shape its type cannot have."""


class _CheckedReader(gguf.GGUFReader):
    """gguf's reader, with each tensor record checked first so a bad one is named (gguf's own errors, e.g.
    "99 is not a valid GGMLQuantizationType", do not say which tensor)."""

    def __init__(self, path: str, light: bool = False) -> None:
        self.light = light
        super().__init__(path)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        """light: a long array (the vocabulary's ~50k-260k strings, scores, types) is stepped over by its lengths
        alone, its values left unread: gguf builds two numpy arrays per string (~150 MB and ~3 s for the default
        model's 98k), which loading the weights never needs. Its field then holds no values."""
        if not self.light or raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = int(self._get(orig_offs, np.uint32)[0])
        alen = int(self._get(orig_offs + 4, np.uint64)[0])
        if alen <= _LIGHT_ARRAY_MIN:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        if itype == gguf.GGUFValueType.STRING:
            u64 = struct.Struct("<Q" if self.byte_order == "I" else ">Q")
            buf = self.data
            for _ in range(alen):
                offs += 8 + u64.unpack_from(buf, offs)[0]
        else:
            nptype = self.gguf_scalar_to_np.get(gguf.GGUFValueType(itype))
            if nptype is None:  # an array of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            offs += alen * np.dtype(nptype).itemsize
        if offs > len(self.data):
            raise ValueError(f"an array of {alen} values runs past the end of the file")
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        return offs - orig_offs, parts, [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(itype)]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for fld in fields:
            _, name_data, _, dims, raw_dtype, offset = fld.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = QType(int(raw_dtype[0]))
            except ValueError:
                raise _BadTensor(f"tensor {name!r} has type id {int(raw_dtype[0])}, which is no ggml type") from None
            block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype in gguf.GGML_QUANT_SIZES else 1
            if len(dims) and int(dims[0]) % block:
                raise _BadTensor(f"tensor {name!r} ({qtype.name}) has rows of {int(dims[0])} values, not whole "
                                 f"{block}-value blocks (shape {list(reversed(dims.tolist()))})")
            if qtype in gguf.GGML_QUANT_SIZES:  # before gguf maps it: its own error names no tensor
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                end = int(start_offs) + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * size // block
                if end > len(self.data):
                    raise _ShortTensor(f"tensor {name!r} ({qtype.name}) extends past the end of the file")
        super()._build_tensors(start_offs, fields)


def _field_value(fld: Any) -> Any:
    """Decode a ReaderField with only the long-stable `parts`/`data`/`types` attributes."""
    types = list(fld.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8") for i in fld.data]
        return [fld.parts[i].tolist()[0] for i in fld.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(fld.parts[-1]).decode("utf-8")
    return fld.parts[-1].tolist()[0]
