"""Stream float32 tensors into a safetensors file and back, one tensor at a time, in a fixed order.

safetensors' own `save_file` needs every tensor in memory at once; for a model being dequantised
that would hold the weights twice. Here the header is written first from the announced layout, and
the tensors follow as they are produced. The yield order is kept in the file's metadata (safetensors
lists keys sorted), so a reader gets the tensors back in the order the writer saw them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

ORDER_KEY = "radixserve.order"  # metadata entry: JSON list of tensor names in stream order

Layout = list[tuple[str, tuple[int, ...]]]


def read_ordered(path: str, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]] | None:
    """A lazy stream of `(name, tensor)` in the order written; None when the file is absent or unsound.

    The header is checked now, not on first use: safetensors refuses a file whose size does not match
    its header, so a truncated or partial file is reported here rather than half way through a load.
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt") as fh:
            order = json.loads((fh.metadata() or {})[ORDER_KEY])
            names = set(fh.keys())
    except Exception as exc:  # noqa: BLE001  # SafetensorError, KeyError, bad JSON: all mean "unsound"
        logger.warning("ignoring damaged safetensors file %s: %s", path, exc)
        return None
    if not isinstance(order, list) or len(order) != len(names) or set(order) != names:
        logger.warning("ignoring %s: its recorded tensor order does not match its header", path)
        return None
    return _read(path, order if keep is None else [n for n in order if keep(n)])


def _read(path: str, order: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        for name in order:
            yield name, fh.get_tensor(name)  # a private copy: callers may modify it freely


def tee_to_file(
    target: str, layout: Layout, stream: Iterator[tuple[str, torch.Tensor]], tmp_prefix: str = ".tmp-"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `stream` unchanged while writing it to the safetensors file `target`.

    `layout` lists every (name, shape) the stream will yield, in order. The file is written under a
    temporary name next to `target` and renamed into place only when the stream ends exactly as
    announced; if the consumer stops early, a tensor differs from the layout or the disk fails, the
    temporary file is deleted and the stream simply carries on unwritten.
    """
    writer: _Writer | None = None
    try:
        writer = _Writer(target, layout, tmp_prefix)
    except OSError as exc:
        logger.warning("could not write %s: %s", target, exc)
    try:
        for name, tensor in stream:
            if writer is not None and not writer.add(name, tensor):
                writer.close(commit=False)
                writer = None
            yield name, tensor
        if writer is not None:
            writer.close(commit=True)
            writer = None
    finally:
        if writer is not None:
            writer.close(commit=False)


class _Writer:
    """A float32 safetensors file written tensor by tensor under a temporary name, header first."""

    def __init__(self, target: str, layout: Layout, tmp_prefix: str) -> None:
        self.target, self.layout, self.count = target, layout, 0
        header: dict[str, Any] = {"__metadata__": {ORDER_KEY: json.dumps([name for name, _ in layout])}}
        offset = 0
        for name, shape in layout:
            end = offset + 4 * int(torch.Size(shape).numel())
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors' own writer does
        folder = os.path.dirname(target) or "."
        fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=tmp_prefix, suffix=".safetensors")
        self.fh = os.fdopen(fd, "wb")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0o600 would hide a shared cache from other users
            self.fh.write(struct.pack("<Q", len(raw)) + raw)
        except OSError:
            self.close(commit=False)
            raise

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Append the next tensor; False (writing nothing) when it is not the one announced."""
        expected = self.layout[self.count] if self.count < len(self.layout) else None
        if expected != (name, tuple(tensor.shape)) or tensor.dtype != torch.float32:
            logger.warning("not writing %s: got %s %s, expected %s", self.target, name, tuple(tensor.shape),
                           expected)  # fmt: skip
            return False
        try:
            self.fh.write(memoryview(tensor.detach().cpu().contiguous().numpy()).cast("B"))
        except OSError as exc:
            logger.warning("could not write %s: %s", self.target, exc)
            return False
        self.count += 1
        return True

    def close(self, commit: bool) -> None:
        """Rename the file into place when `commit` and complete; otherwise delete it."""
        try:
            if commit and self.count == len(self.layout):
                self.fh.flush()
                os.fsync(self.fh.fileno())  # a power cut must not leave a full-size file of zeros behind
                self.fh.close()
                os.replace(self.tmp, self.target)
                return
        except OSError as exc:
            logger.warning("could not write %s: %s", self.target, exc)
        self.fh.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)
