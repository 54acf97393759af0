"""Which low-bit format each projection gets, from `--quantization` and the checkpoint.

    auto   a GGUF file's own blocks, kept packed instead of dequantised, as gguf_formats.FORMATS says:
             exact types (Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) -> their kernel kind, the file's values
                                                                     exactly
             F32, F16, BF16                                       -> float (no low-bit copy)
             requant types (IQ1/IQ2/IQ3, TQ, MXFP4)              -> re-quantised from the dequantised
                                                                     weights (one log line per type)
           a projection stacked from several tensors (q/k/v, gate/up) of different exact types takes the
           join of their kinds (qweight.join_kinds: exact too); a float tensor among low-bit ones makes
           the whole projection re-quantise to Q8_0.
           a Hugging Face folder: float, no low-bit copy.
           MoE experts (FusedMoE) the same way from the file's 3-D ffn_{gate,up,down}_exps blocks, expert by
           expert (a 3-D tensor has one type, so every expert of a projection gets one kind).
    int8   every projection and the LM head quantised to Q8_0 at load (absmax per 32-block)
    int4   every projection and the LM head quantised to Q4_1 at load (min/max per 32-block)
    none   float only (the exact mode)

The low-bit copy is what every step uses (the float copies are then released), unless --quant-max-rows caps it
(an opt-in for bf16 GEMMs on long steps); layers/linear.py: resolve_low_bit_max_rows.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.linear import PackableLinear
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.expert_slab import Empty, ExpertSlab, new_tensor
from radixserve.layers.quantization.gguf_formats import FORMATS
from radixserve.layers.quantization.qweight import (
    KIND_NAMES,
    KINDS,
    QBLOCK,
    QKIND_Q4_1,
    QKIND_Q8_0,
    QROWS,
    ExpertQuantWeight,
    QuantRows,
    QuantWeight,
    join_kinds,
)
from radixserve.server_args import QUANTIZATION_MODES

logger = logging.getLogger(__name__)

@dataclass
class QuantReport:
    """What a plan did: per kernel kind the number of layers, the layers re-quantised, and the layers left
    on the float path per file type (F16 / BF16 / F32 projections: no low-bit copy)."""

    counts: dict[str, int] = field(default_factory=dict)
    requantized: list[str] = field(default_factory=list)
    requantized_by_type: dict[str, list[str]] = field(default_factory=dict)  # "IQ2_XS" -> layer names
    float_layers: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    mapped_bytes: int = 0  # of `bytes`, mapped from the weight cache (model_loader/weight_cache.py)

    def summary(self) -> str:
        parts = [f"{n} x {k}" for k, n in sorted(self.counts.items())]
        parts += [f"{n} x {t} on the float path" for t, n in sorted(self.float_layers.items())]
        return ", ".join(parts) or "no low-bit layers"


class BlockSource(Protocol):
    """A checkpoint's low-bit tensors by HF name (model_loader/gguf.py: GGUFBlocks, over the mapped file)."""

    def __contains__(self, name: object) -> bool: ...
    def qtype(self, name: str) -> str: ...
    def exact(self, name: str) -> bool: ...
    def rows(self, name: str) -> np.ndarray: ...


# dense(module name, module) -> its float weights: [out, in] for a projection, (w13, w2) of the local
# experts for a FusedMoE; asked for only where a layer is (re-)quantised from floats, one layer at a time
Dense = Callable[[str, nn.Module], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def quantize_model(
    model: nn.Module,
    mode: str,
    sources: Callable[[str], list[tuple[str, object]]],
    dense: Dense,
    gguf_blocks: BlockSource | None = None,
    prepacked: dict[str, QuantWeight | tuple[ExpertQuantWeight, ExpertQuantWeight]] | None = None,
) -> QuantReport:
    """Give every PackableLinear of `model` its QuantWeight (or none) for `mode`, layer by layer.

    sources(module_name) -> the checkpoint tensors stacked into it, in row order, as (name, shard id);
    dense: see Dense;
    gguf_blocks: the file's blocks, for `auto` on a GGUF model (None otherwise). Each projection's blocks are
    read from it, converted and packed before the next is read: the working set is one layer's.
    prepacked: module name -> its packed weights from an earlier load (model_loader/weight_cache.py), taken as
    they are.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    report = QuantReport()
    if mode == "none" or (mode == "auto" and gguf_blocks is None):
        return report
    seen: set[int] = set()
    prepacked = prepacked or {}
    for name, mod in model.named_modules():
        done = prepacked.get(name)
        if isinstance(mod, FusedMoE):
            if isinstance(done, tuple):
                mod.set_low_bit(*done)
                _count(report, *done)
            else:
                _plan_experts(name, mod, mode, gguf_blocks, dense, report)
            continue
        if not isinstance(mod, PackableLinear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        qw = done if isinstance(done, QuantWeight) else _plan_one(name, mod, mode, sources(name), dense, gguf_blocks,
                                                                   report)
        mod.qweight = qw
        if qw is not None:
            _count(report, qw)
    for types, names in sorted(report.requantized_by_type.items()):  # one line per type, never silent
        logger.info("quantization auto: GGUF %s has no exact kernel layout: %d layers re-quantised (first: %s)",
                    types, len(names), names[0])
    return report


def _plan_one(name: str, mod: nn.Module, mode: str, srcs: list[tuple[str, object]], dense: Dense,
              gguf_blocks: BlockSource | None, report: QuantReport) -> QuantWeight | None:
    if mode == "int8":
        return QuantWeight.quantize(dense(name, mod), QKIND_Q8_0, name)  # type: ignore[arg-type]
    if mode == "int4":
        return QuantWeight.quantize(dense(name, mod), QKIND_Q4_1, name)  # type: ignore[arg-type]
    assert gguf_blocks is not None
    if not srcs or any(s not in gguf_blocks for s, _ in srcs):
        return None  # not from the file (should not happen): keep float
    fmts = [FORMATS[gguf_blocks.qtype(s)] for s, _ in srcs]  # the loader refused any other type
    types = "+".join(sorted({f.name for f in fmts}))
    if all(f.handling == "float" for f in fmts):
        report.float_layers[types] = report.float_layers.get(types, 0) + 1
        return None
    if all(gguf_blocks.exact(s) for s, _ in srcs):
        return _pack_exact(name, mod, fmts, srcs, gguf_blocks)
    want = _requant_kind(name, fmts, types, report)
    return QuantWeight.quantize(dense(name, mod), want, name)  # type: ignore[arg-type]


# Rows converted at a time (a multiple of QROWS): the file's blocks unpack to one byte a weight and more on the
# way to the kernel layout, ~5x the packed bytes; a 128k-vocabulary LM head in one piece took ~2.7 GB.
PACK_ROWS = 4096


@dataclass(frozen=True)
class _Piece:
    """Rows [r0, r1) of one stacked source's part for this rank (after its dim-0 cut), or `zeros` padding rows."""

    src: int
    r0: int
    r1: int
    zeros: bool = False


def _pack_exact(name: str, mod: nn.Module, fmts: list, srcs: list[tuple[str, object]],
                blocks: BlockSource) -> QuantWeight:
    """A projection's kernel layout from the file's blocks of its stacked sources, PACK_ROWS output rows at a
    time, each source cut for this tensor-parallel rank by the layer's own rule (quant_cut). Every 8-row group is
    packed on its own (QuantWeight.from_rows), so the chunks are bit for bit the whole matrix packed at once."""
    kind = join_kinds([f.kind for f in fmts])
    views, cuts = [], []
    for s, sid in srcs:
        raw = blocks.rows(s)
        dim, start, length, padded = mod.quant_cut(sid, raw.shape[0])  # type: ignore[operator]
        raw = raw[start : start + length] if dim == 0 else raw
        if raw.shape[0] == 0:
            raise ValueError(f"quantization: layer {name} holds no rows of {s} on this rank")
        views.append(raw)
        cuts.append((dim, start, length, padded))

    fast = _repack_in_cpp(fmts, views, cuts)
    if fast is not None:
        return fast

    def convert(piece: _Piece) -> QuantRows:
        f, raw, (dim, start, length, _) = fmts[piece.src], views[piece.src], cuts[piece.src]
        part = f.rows(raw[piece.r0 : piece.r1], srcs[piece.src][0])
        part = part.narrow(1, start, length, name) if dim == 1 else part
        return part.promote(kind)

    # factored scales only if every source keeps them (a K cut off the 256-blocks drops them): one group's rows
    factored = all(convert(_Piece(i, 0, min(QROWS, v.shape[0]))).factors is not None for i, v in enumerate(views))
    # the output rows in order: each source's rows, then the zero rows of a padded vocabulary slice
    pieces: list[_Piece] = []
    for i, v in enumerate(views):
        pieces.append(_Piece(i, 0, v.shape[0]))
        if cuts[i][0] == 0 and cuts[i][3] > v.shape[0]:
            pieces.append(_Piece(i, v.shape[0], cuts[i][3], zeros=True))
    chunks: list[list[_Piece]] = [[]]
    room = PACK_ROWS
    for p in pieces:
        r = p.r0
        while r < p.r1:
            take = min(room, p.r1 - r)
            chunks[-1].append(_Piece(p.src, r, r + take, p.zeros))
            r, room = r + take, room - take
            if room == 0:
                chunks.append([])
                room = PACK_ROWS
    chunks = [c for c in chunks if c]

    def pack(chunk: list[_Piece]) -> QuantWeight:
        parts = []
        for p in chunk:
            if p.zeros:  # zero rows compute 0 (the vocabulary's padding): a real row's shape, zeroed
                z = convert(_Piece(p.src, 0, 1))
                parts.append(z.narrow(0, 0, 0).pad_rows(p.r1 - p.r0))
            else:
                parts.append(convert(p))
        if not factored:
            parts = [dataclasses.replace(x, factors=None) for x in parts]
        return QuantWeight.from_rows(QuantRows.cat(parts))

    # NOTE: one chunk at a time. Two in flight on threads gained 13% on 2 vCPUs (torch's element-wise ops already
    # use both cores) and left ~0.9 GB of freed chunks in glibc's per-thread arenas after an 8B load.
    return QuantWeight.cat_groups([pack(c) for c in chunks])


# GGUF types csrc/repack.cpp turns into the kernel layout in one pass, by ggml type id: the K-quants (stacks of
# either or both) and the legacy types (stacks of one type; float16 scales as the file's)
_CPP_REPACK = {"Q4_K": 12, "Q6_K": 14}
_CPP_LEGACY = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _repack_in_cpp(fmts: list, views: list[np.ndarray], cuts: list[tuple[int, int, int, int]],
                   empty: Empty = new_tensor) -> QuantWeight | None:
    """The common case of a K-quant file (every stacked source Q4_K or Q6_K; whole rows of this rank, in whole
    8-row groups, no padding) packed by csrc/repack.cpp, byte for byte what the general path makes (~20x faster:
    one pass over the mapped blocks instead of ~10 over one byte a weight). A stack of one type keeps its kind; a
    mixed one (Q4_K_M's q/k in Q4_K, v in Q6_K) takes their join, Q8_M16. None: the general path's case (other
    types, a K cut, a padded vocabulary slice, no C++ kernels, a non-finite scale). `empty` makes the output tensors
    (an MoE projection's: rows of its ExpertSlab)."""
    names = {f.name for f in fmts}
    if not (names <= set(_CPP_REPACK) or (len(names) == 1 and names <= set(_CPP_LEGACY))):
        return None
    if any(dim != 0 or padded != v.shape[0] or v.shape[0] % QROWS for v, (dim, _, _, padded) in zip(views, cuts)):
        return None
    ops, _ = load_cpu_ops()
    if ops is None:
        return None
    if names <= set(_CPP_LEGACY):
        return _repack_legacy(ops, fmts[0], views, empty)
    mixed = len(names) > 1
    kind = join_kinds([f.kind for f in fmts])
    nj = views[0].shape[1] // fmts[0].block_bytes  # super-blocks a row: one K for every stacked source
    n = sum(v.shape[0] for v in views)
    # the whole stack's tensors at once, each source's 8-row groups written in place (no copy to join them)
    block_data = KINDS[kind].block_bytes
    record = 32 + 64 * (QBLOCK // KINDS[kind].group)  # 8 float32 super-scales + int8 subs of 8 rows
    data = empty((n // QROWS, nj * 8 * block_data), torch.uint8)
    d = empty((n // QROWS, nj * record), torch.uint8)
    m = empty(tuple(d.shape), d.dtype) if KINDS[kind].has_min else None
    g0 = 0
    for f, v in zip(fmts, views):
        g1 = g0 + v.shape[0] // QROWS
        with warnings.catch_warnings():  # read-only: the mapped file is only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(v))
        qid = _CPP_REPACK[f.name]
        if mixed:
            assert m is not None  # Q8_M16 has mins
            done = ops.repack_kquant_m16(raw, qid, data[g0:g1], d[g0:g1], m[g0:g1])
        else:
            done = ops.repack_kquant(raw, qid, data[g0:g1], d[g0:g1], None if m is None else m[g0:g1])
        if not done:
            return None
        g0 = g1
    if not KINDS[kind].packed:
        data = data.view(torch.int8)  # an 8-bit kind's values are signed (the general path's dtype)
    return QuantWeight(kind, n, nj * fmts[0].block_size, data, d, m)


def _repack_legacy(ops: object, f: object, views: list[np.ndarray], empty: Empty) -> QuantWeight | None:
    """A stack of one legacy type (Q4_0 / Q4_1 / Q8_0) by csrc/repack.cpp, scales float16 as the file's."""
    kind = KINDS[f.kind]  # type: ignore[attr-defined]
    nb = views[0].shape[1] // f.block_bytes  # type: ignore[attr-defined]
    n = sum(v.shape[0] for v in views)
    data = empty((n // QROWS, nb * kind.block_bytes), torch.uint8)
    d = empty((n // QROWS, nb * QROWS), torch.float16)
    m = empty(tuple(d.shape), d.dtype) if kind.has_min else None
    g0 = 0
    for v in views:
        g1 = g0 + v.shape[0] // QROWS
        with warnings.catch_warnings():  # read-only: the mapped file is only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(v))
        if not ops.repack_legacy(raw, _CPP_LEGACY[f.name], data[g0:g1], d[g0:g1].view(torch.uint8),  # type: ignore
                                 None if m is None else m[g0:g1].view(torch.uint8)):
            return None
        g0 = g1
    return QuantWeight(kind.id, n, nb * QBLOCK, data if kind.packed else data.view(torch.int8), d, m)


def _requant_kind(name: str, fmts: list, types: str, report: QuantReport) -> int:
    """The kind a layer whose tensors cannot all stay exact is re-quantised to (recorded in the report): a
    float tensor stacked with low-bit ones keeps 8 bits; else the re-quantised types' own target."""
    targets = [QKIND_Q8_0 if f.handling == "float" else f.kind if f.handling == "exact" else f.requant_kind
               for f in fmts]
    want = QKIND_Q8_0 if any(KIND_NAMES[t] != "Q4_1" for t in targets) else QKIND_Q4_1  # type: ignore[index]
    report.requantized.append(f"{name} ({types} -> {KIND_NAMES[want]})")
    report.requantized_by_type.setdefault(types, []).append(name)
    return want


def _plan_experts(name: str, mod: FusedMoE, mode: str, gguf_blocks: BlockSource | None, dense: Dense,
                  report: QuantReport) -> None:
    """FusedMoE's low-bit copy (ExpertQuantWeight for gate_up and down) by the same rules as a projection's."""
    local = range(mod.expert_offset, mod.expert_offset + mod.num_local)
    want: int | None = {"int8": QKIND_Q8_0, "int4": QKIND_Q4_1}.get(mode)
    if want is None:  # auto: the file's own blocks
        assert gguf_blocks is not None
        srcs = [f"{name}.{p}_proj.weight" for p in ("gate", "up", "down")]
        if any(s not in gguf_blocks for s in srcs):
            return  # not from the file (should not happen): keep float
        fmts = [FORMATS[gguf_blocks.qtype(s)] for s in srcs]
        types = "+".join(sorted({f.name for f in fmts}))
        if all(f.handling == "float" for f in fmts):
            report.float_layers[types] = report.float_layers.get(types, 0) + 2
            return
        if all(gguf_blocks.exact(s) for s in srcs):
            blocks = [gguf_blocks.rows(s) for s in srcs]  # [experts, out, row bytes] views of the mapped file

            def expert_rows(i: int, e: int) -> QuantRows:
                part = ("gate", "up", "down")[i]
                src = f"{name}.{part}_proj.weight[{e}]"
                return mod.shard_rows(part, fmts[i].rows(blocks[i][e], src), src)

            slabs = {0: ExpertSlab(len(local)), 2: ExpertSlab(len(local))}  # gate_up's and down's

            def packed(parts: list[int], e: int) -> QuantWeight | QuantRows:
                """An expert's projection: csrc/repack.cpp's one pass where it applies (every part Q4_K or every
                one Q6_K, no expert-TP cut), into its row of the projection's slab; else the converted rows
                (packed by _set_experts)."""
                if mod.ps.moe_tp_size == 1:
                    views = [blocks[i][e] for i in parts]
                    whole = [(0, 0, v.shape[0], v.shape[0]) for v in views]
                    slab = slabs[parts[0]].empty_for(e - mod.expert_offset)
                    fast = _repack_in_cpp([fmts[i] for i in parts], views, whole, slab)
                    if fast is not None:
                        return fast
                rows = [expert_rows(i, e) for i in parts]
                return rows[0] if len(rows) == 1 else _joined(*rows)

            _set_experts(mod, [packed([0, 1], e) for e in local], [packed([2], e) for e in local], report)
            return
        want = _requant_kind(name, fmts, types, report)
    w13, w2 = dense(name, mod)  # type: ignore[misc]
    _set_experts(mod, [QuantRows.quantize(w13[e], want, f"{name}.w13[{e}]") for e in range(mod.num_local)],
                 [QuantRows.quantize(w2[e], want, f"{name}.w2[{e}]") for e in range(mod.num_local)], report)


def _joined(a: QuantRows, b: QuantRows) -> QuantRows:
    """gate rows then up rows in the join of their kinds (exact: join_kinds)."""
    kind = join_kinds([a.kind, b.kind])
    return QuantRows.cat([a.promote(kind), b.promote(kind)])


def _set_experts(mod: FusedMoE, gate_up: list[QuantRows | QuantWeight], down: list[QuantRows | QuantWeight],
                 report: QuantReport) -> None:
    def weight(r: QuantRows | QuantWeight) -> QuantWeight:
        return r if isinstance(r, QuantWeight) else QuantWeight.from_rows(r)

    w13 = ExpertQuantWeight.stack([weight(r) for r in gate_up])
    w2 = ExpertQuantWeight.stack([weight(r) for r in down])
    mod.set_low_bit(w13, w2)
    _count(report, w13, w2)


def _count(report: QuantReport, *weights: QuantWeight | ExpertQuantWeight) -> None:
    for w in weights:
        report.counts[w.name] = report.counts.get(w.name, 0) + 1
        report.bytes += w.nbytes()
