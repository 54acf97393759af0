"""The kernels' layout of a GGUF's low-bit weights, kept beside its config in the GGUF cache and mapped on the
next start: a warm start without a repack.

Repacking an 8B Q4_K_M file costs ~3 s on two cores, and half of that is the kernel zeroing 4.7 GB of new
anonymous pages. Pages already in the page cache map in ~0.2 s for the same 4.7 GB. So the first load writes each
packed layer (QuantWeight, a MoE layer's two ExpertQuantWeights) to one file, on a thread once the model is
loaded, and the next load maps that file copy-on-write (MAP_PRIVATE) and builds the same tensors as views of it:
the weights are then page cache, shared by every process that maps the file, not private memory.

    <GGUF cache entry>/weights-<tag>.bin    every cached tensor at a 4 KiB-aligned offset
    <GGUF cache entry>/weights-<tag>.json   the index: per layer its kind, shape, signature and tensors'
                                            (dtype, shape, offset); the .bin's size and checksum

The entry folder is the GGUF's own (gguf_cache.cache_entry: the file's real path, size and mtime). The tag
(weight_check.weight_tag) names what else decides the bytes: the quantization mode, the replica's tp / pp / ep
sizes and the code that makes the layout (weight_check.LAYOUT_SOURCES), then this rank's indices, so an edit
there, another mode or another layout misses.

Trust: the .bin is mapped only if its size and digest (model_loader/weight_check.py: every byte, computed as the
scheduler process starts, beside its torch import) match the index, the index's layer records match their own
digest, and each layer is taken only if the model's layer has the signature it was saved with. A truncated, corrupt or foreign file is a miss, deleted, logged once,
and written again from the repack.

Size: the entry never holds more than the GGUF file: each rank's .bin gets its share of what the config and
tokenizer leave (or will leave: the HTTP process may save the tokenizer after this write), filled with the largest
layers that fit; the rest are repacked at every start (an 8B: ~0.1 GB of
its 4.7). Other layouts' files in the
entry are deleted when one is written, and nothing is written where the disk would keep less than 1 GiB free.
`--disable-weight-cache` or RADIXSERVE_NO_GGUF_CACHE=1 turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.layers.linear import PackableLinear
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.qweight import KINDS, QBLOCK, QROWS, ExpertQuantWeight, QuantWeight
from radixserve.model_loader.gguf_cache import (
    _TMP_PREFIX,
    WEIGHTS_PREFIX,
    CacheEntry,
    _prepare,
    _write_json,
    cache_entry,
)
from radixserve.model_loader.weight_check import (
    INDEX_VERSION,
    FileKey,
    checked_digest,
    file_digest,
    file_key,
    weight_tag,
)
from radixserve.process_exit import before_exit

logger = logging.getLogger(__name__)

ALIGN = 4096  # every tensor starts on a page: the kernels' 64-byte loads never straddle two tensors
MIN_FREE_DISK = 1 << 30  # bytes the disk keeps free after a write
_DTYPES = {str(t): t for t in (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32)}

# what one layer holds: a projection's QuantWeight, or a MoE layer's (gate_up, down)
Packed = QuantWeight | tuple[ExpertQuantWeight, ExpertQuantWeight]

_WRITERS: list[tuple[threading.Thread, threading.Event]] = []  # this process's writes in flight


class _Aborted(Exception):
    pass


def wait_writes(timeout_s: float = 60.0) -> None:
    """Let this process's cache writes in flight finish (a caller that loads models in its own process: tests)."""
    for thread, _ in _WRITERS[:]:  # a copy: a load may start a writer meanwhile
        thread.join(timeout_s)


def abort_writes(timeout_s: float = 2.0) -> None:
    """Stop this process's cache writes in flight, their temporary files deleted (a server stopped seconds after
    its first start: the next start writes the cache again instead of finding gigabytes of debris)."""
    for _, stop in _WRITERS:
        stop.set()
    for thread, _ in _WRITERS:
        thread.join(timeout_s)


def signature(mod: nn.Module) -> list[int]:
    """What a layer's packed weights must fit: a projection's [out, in] on this rank, a MoE layer's local experts
    and their dimensions."""
    if isinstance(mod, FusedMoE):
        return [mod.num_local, mod.expert_offset, mod.inter_per_rank, mod.hidden_size]
    assert isinstance(mod, PackableLinear)
    return list(mod.weight_dims())


def packed_of(mod: nn.Module) -> Packed | None:
    if isinstance(mod, FusedMoE):
        return mod.low_bit
    return mod.qweight  # type: ignore[return-value]


@dataclass
class WeightCache:
    """One rank's cached layout of one GGUF file in one quantization mode."""

    entry: CacheEntry
    tag: str
    share: int  # ranks holding one model between them: each .bin gets its share of the file's size
    reserve: int  # bytes kept for the entry's config and tokenizer, which another process may write after us
    budget: int | None = None  # most bytes the .bin may hold; None: its share of what the entry's other files leave

    @staticmethod
    def open(path: str, mode: str, sizes: tuple[int, int, int], ranks: tuple[int, int],
             vocab_size: int) -> WeightCache | None:
        """The cache of `path` in `mode` for the rank at `ranks` (its tp / pp indices) of a replica laid out as
        `sizes` (tp / pp / ep sizes), whose tokenizer has `vocab_size` pieces; None when caching is off."""
        entry = cache_entry(path)
        if entry is None:
            return None
        # a saved tokenizer takes 72-128 bytes a piece (SmolLM2's 49k, Gemma 3's 262k): room for twice that
        reserve = (1 << 16) + 256 * max(0, vocab_size)
        return WeightCache(entry, weight_tag(mode, sizes, ranks), sizes[0] * sizes[1], reserve)

    @property
    def bin_path(self) -> str:
        return self.entry.file(f"{WEIGHTS_PREFIX}{self.tag}.bin")

    @property
    def index_path(self) -> str:
        return self.entry.file(f"{WEIGHTS_PREFIX}{self.tag}.json")

    # --- load -------------------------------------------------------------------------------------------

    def restore(self, layers: list[tuple[str, nn.Module]]) -> dict[str, Packed]:
        """The packed weights of every cached layer of `layers` whose signature matches, as views of the mapped
        file; {} on a miss (absent, unreadable, wrong size or checksum: then deleted, so the next save rewrites)."""
        t0 = time.perf_counter()
        try:
            with open(self.index_path, encoding="utf-8") as fh:
                index = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            return self._reject(f"unreadable index ({exc})")
        try:
            if index["version"] != INDEX_VERSION or index["tag"] != self.tag:
                return self._reject("an index of another layout")
            mapped = self._map(int(index["bytes"]))
            if mapped is None:
                return self._reject(f"the file is not the {index['bytes']} bytes its index names")
            key, whole = mapped
            if checked_digest(self.bin_path, key, whole.numpy()) != index["bin_digest"] or \
                    _digest(index["layers"]) != index["layers_digest"]:
                return self._reject("checksum mismatch")
            by_name = dict(layers)
            out: dict[str, Packed] = {}
            for name, rec in index["layers"].items():
                mod = by_name.get(name)
                if mod is not None and rec["signature"] == signature(mod):
                    packed = _rebuild(whole, rec)
                    if _fits(mod, packed):
                        out[name] = packed
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return self._reject(f"malformed index ({type(exc).__name__}: {exc})")
        logger.info("weight cache: %d of %d layers mapped from %s (%.2f GiB, checked in %.2f s)", len(out),
                    len(layers), self.bin_path, int(index["bytes"]) / 2**30, time.perf_counter() - t0)
        return out

    def _map(self, size: int) -> tuple[FileKey, torch.Tensor] | None:
        """(the file's identity, its bytes mapped); None if it is not `size` bytes."""
        try:
            with open(self.bin_path, "rb") as fh:
                key = file_key(fh.fileno())
                if key[2] != size or size == 0:
                    return None
                # copy-on-write: a write into a weight (none is expected) would stay private, never reach the file
                mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        except OSError:
            return None
        return key, torch.frombuffer(mapped, dtype=torch.uint8)  # keeps `mapped` alive while a view of it lives

    def _reject(self, why: str) -> dict[str, Packed]:
        logger.warning("weight cache: %s in %s; repacking from the GGUF file (and writing it again)", why,
                       self.bin_path)
        for p in (self.index_path, self.bin_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        return {}

    # --- save -------------------------------------------------------------------------------------------

    def save_async(self, layers: list[tuple[str, nn.Module]]) -> threading.Thread | None:
        """Write the packed layers of `layers` on a daemon thread; None when none is packed. A failure is a log
        line: the cache is an optimisation, never the load's problem."""
        packed = [(name, mod, p) for name, mod in layers
                  if (p := packed_of(mod)) is not None and all(str(t.dtype) in _DTYPES for t in _tensors(p))]
        if not packed:
            return None
        stop = threading.Event()
        thread = threading.Thread(target=self._save, args=(packed, stop), name="rs-weight-cache", daemon=True)
        _WRITERS[:] = [w for w in _WRITERS if w[0].is_alive()]
        _WRITERS.append((thread, stop))
        before_exit(abort_writes)  # a server stopped during the write deletes its temporary file
        thread.start()
        return thread

    def _choose(self, packed: list[tuple[str, nn.Module, Packed]]) -> tuple[list[tuple[str, nn.Module, Packed]], int]:
        """As many layers as the budget holds, largest first (what is left out is then the smallest remainder: an
        8B's LM head fits, a few of its smaller projections not), and their bytes in the file."""
        others = max(self._other_bytes(), self.reserve)
        budget = self.budget if self.budget is not None else (self.entry.size - others) // self.share
        chosen, total = [], 0
        for item in sorted(packed, key=lambda x: -_file_bytes(x[2])):  # stable: model order among equals
            if total + _file_bytes(item[2]) <= budget:
                chosen.append(item)
                total += _file_bytes(item[2])
        return chosen, total

    def _save(self, layers: list[tuple[str, nn.Module, Packed]], stop: threading.Event) -> None:
        t0, tmp = time.perf_counter(), None
        try:
            _prepare(self.entry)
            chosen, total = self._choose(layers)
            if not chosen:
                logger.warning("weight cache: no layer fits in %s beside its other files", self.entry.folder)
                return
            if shutil.disk_usage(self.entry.folder).free < total + MIN_FREE_DISK:
                logger.warning("weight cache: not written, %s has less than %.2f GiB free", self.entry.folder,
                               (total + MIN_FREE_DISK) / 2**30)
                return
            fd, tmp = tempfile.mkstemp(dir=self.entry.folder, prefix=_TMP_PREFIX, suffix=".bin")
            os.fchmod(fd, 0o644)
            layers_index: dict[str, Any] = {}
            offset = 0
            with os.fdopen(fd, "wb") as fh:
                for name, mod, packed in chosen:
                    weights = []
                    for w in (packed if isinstance(packed, tuple) else (packed,)):
                        rec = {"kind": w.kind, "n": w.n, "k": w.k}
                        for field_name in ("data", "d", "m"):
                            t = getattr(w, field_name)
                            rec[field_name] = None if t is None else [str(t.dtype), list(t.shape), offset]
                            if t is not None:
                                if stop.is_set():
                                    raise _Aborted
                                offset = _write(fh, t, offset)
                        weights.append(rec)
                    layers_index[name] = {"signature": signature(mod), "experts": isinstance(packed, tuple),
                                          "weights": weights}
            if offset != total:
                raise RuntimeError(f"wrote {offset} bytes, planned {total}")
            checked = file_digest(tmp)  # what the disk holds, as a load will read it
            if checked is None:
                raise OSError(f"cannot read back {tmp}")
            self._drop_other_layouts()
            os.replace(tmp, self.bin_path)
            tmp = None
            _write_json(self.entry, os.path.basename(self.index_path), {
                "version": INDEX_VERSION, "tag": self.tag, "bytes": total, "bin_digest": checked[1],
                "layers": layers_index, "layers_digest": _digest(layers_index)})
            logger.info("weight cache: wrote %d layers (%.2f GiB) to %s in %.1f s", len(chosen), total / 2**30,
                        self.bin_path, time.perf_counter() - t0)
        except _Aborted:
            logger.info("weight cache: write to %s stopped with the process", self.entry.folder)
        except Exception as exc:  # noqa: BLE001  # a full disk, a removed folder: the served model is unaffected
            logger.warning("weight cache: not written to %s: %s", self.entry.folder, exc)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _other_bytes(self) -> int:
        """Bytes of the entry's config, tokenizer and other records: the whole entry stays within the file."""
        total = 0
        for folder, _, names in os.walk(self.entry.folder):
            for n in names:
                if not n.startswith((WEIGHTS_PREFIX, _TMP_PREFIX)):
                    try:
                        total += os.path.getsize(os.path.join(folder, n))
                    except OSError:
                        pass  # replaced under us by another process's write: its new copy is counted next time
        return total

    def _drop_other_layouts(self) -> None:
        """Delete the files of another mode, replica layout or code version: the entry keeps one layout's ranks,
        so its weights stay within the file's size."""
        layout = self.tag.split("-")[0]
        for name in os.listdir(self.entry.folder):
            if name.startswith(WEIGHTS_PREFIX) and not name.startswith(f"{WEIGHTS_PREFIX}{layout}-"):
                try:
                    os.unlink(os.path.join(self.entry.folder, name))
                except OSError:
                    pass


def _fits(mod: nn.Module, packed: Packed) -> bool:
    """Whether `packed` has the shapes the layer's kernels will read (an index that lies about them with a right
    digest is one written by hand: the layer is then repacked, never read out of bounds)."""
    if isinstance(mod, FusedMoE):
        want = [(mod.num_local, 2 * mod.inter_per_rank, mod.hidden_size), (mod.num_local, mod.hidden_size,
                                                                             mod.inter_per_rank)]
        return isinstance(packed, tuple) and all(
            (w.num_experts, w.n, w.k) == shape and w.data.numel() == w.num_experts * _data_bytes(w.kind, w.n, w.k)
            for w, shape in zip(packed, want))
    return isinstance(packed, QuantWeight) and [packed.n, packed.k] == signature(mod) and \
        packed.data.numel() == _data_bytes(packed.kind, packed.n, packed.k)


def _data_bytes(kind: int, n: int, k: int) -> int:
    """Bytes of an n x k weight's data in `kind`'s interleaved layout (qweight.QuantWeight.from_rows)."""
    return -(-n // QROWS) * (k // QBLOCK) * KINDS[kind].block_bytes if kind in KINDS else -1


def _digest(layers: dict[str, Any]) -> str:
    """The index's own checksum: a damaged layer record (a kind, a shape, an offset) is a miss, not a misread."""
    return hashlib.sha256(json.dumps(layers, sort_keys=True).encode()).hexdigest()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def packed_bytes(packed: Packed) -> int:
    """A layer's packed bytes (unaligned: what the model holds)."""
    return sum(t.numel() * t.element_size() for t in _tensors(packed))


def _file_bytes(packed: Packed) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for t in _tensors(packed))


def _tensors(packed: Packed) -> list[torch.Tensor]:
    weights = packed if isinstance(packed, tuple) else (packed,)
    return [t for w in weights for t in (w.data, w.d, w.m) if t is not None]


def _write(fh: Any, t: torch.Tensor, offset: int) -> int:
    """Write `t`'s bytes at `offset` (the file's end) and pad to the next page; the new end."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    fh.write(memoryview(raw))
    end = offset + raw.nbytes
    pad = _aligned(end) - end
    if pad:
        fh.write(b"\0" * pad)
    return end + pad


def _rebuild(whole: torch.Tensor, rec: dict[str, Any]) -> Packed:
    def tensor(spec: list | None) -> torch.Tensor | None:
        if spec is None:
            return None
        dtype, shape, offset = _DTYPES[spec[0]], [int(s) for s in spec[1]], int(spec[2])
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % ALIGN or offset < 0 or offset + nbytes > whole.numel():
            raise ValueError(f"tensor at {offset} of {nbytes} bytes is outside the file")
        return whole[offset: offset + nbytes].view(dtype).view(shape)

    weights = []
    for w in rec["weights"]:
        data, d = tensor(w["data"]), tensor(w["d"])
        if data is None or d is None:
            raise ValueError("a weight without data or scales")
        weights.append((int(w["kind"]), int(w["n"]), int(w["k"]), data, d, tensor(w["m"])))
    if rec["experts"]:
        if len(weights) != 2:
            raise ValueError("a MoE layer needs two weights")
        return ExpertQuantWeight(*weights[0]), ExpertQuantWeight(*weights[1])
    if len(weights) != 1:
        raise ValueError("a projection has one weight")
    return QuantWeight(*weights[0])
