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

The low-bit copy is what every step uses on a CPU whose float GEMMs would be float32 (the float copies are
then released), and steps of up to ModelRunner.quant_max_rows rows where they are bf16 (AMX wins the
long, compute-bound ones); layers/linear.py: resolve_low_bit_max_rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.layers.linear import PackableLinear
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.gguf_formats import FORMATS
from radixserve.layers.quantization.qweight import (
    KIND_NAMES,
    QKIND_Q4_1,
    QKIND_Q8_0,
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

    def summary(self) -> str:
        parts = [f"{n} x {k}" for k, n in sorted(self.counts.items())]
        parts += [f"{n} x {t} on the float path" for t, n in sorted(self.float_layers.items())]
        return ", ".join(parts) or "no low-bit layers"


def quantize_model(
    model: nn.Module,
    mode: str,
    sources: Callable[[str], list[tuple[str, object]]],
    dense: Callable[[nn.Module], torch.Tensor],
    gguf_blocks: dict[str, tuple[str, torch.Tensor | None]] | None = None,
) -> QuantReport:
    """Give every PackableLinear of `model` its QuantWeight (or none) for `mode`.

    sources(module_name) -> the checkpoint tensors stacked into it, in row order, as (name, shard id);
    dense(module) -> its float weight [out, in] (before packing frees it);
    gguf_blocks: gguf_tensor_blocks() of the file, for `auto` on a GGUF model (None otherwise).
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    report = QuantReport()
    if mode == "none" or (mode == "auto" and gguf_blocks is None):
        return report
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, FusedMoE):
            _plan_experts(name, mod, mode, gguf_blocks, report)
            continue
        if not isinstance(mod, PackableLinear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        qw = _plan_one(name, mod, mode, sources(name), dense, gguf_blocks, report)
        mod.qweight = qw
        if qw is not None:
            report.counts[qw.name] = report.counts.get(qw.name, 0) + 1
            report.bytes += qw.nbytes()
    for types, names in sorted(report.requantized_by_type.items()):  # one line per type, never silent
        logger.info("quantization auto: GGUF %s has no exact kernel layout: %d layers re-quantised (first: %s)",
                    types, len(names), names[0])
    return report


def _plan_one(name: str, mod: nn.Module, mode: str, srcs: list[tuple[str, object]],
              dense: Callable[[nn.Module], torch.Tensor],
              gguf_blocks: dict[str, tuple[str, torch.Tensor | None]] | None, report: QuantReport) -> QuantWeight | None:
    if mode == "int8":
        return QuantWeight.quantize(dense(mod), QKIND_Q8_0, name)
    if mode == "int4":
        return QuantWeight.quantize(dense(mod), QKIND_Q4_1, name)
    assert gguf_blocks is not None
    entries = [gguf_blocks.get(s) for s, _ in srcs]
    if not entries or any(e is None for e in entries):
        return None  # not from the file (should not happen): keep float
    fmts = [FORMATS[qt] for qt, _ in entries]  # type: ignore[misc]  # the loader refused any other type
    types = "+".join(sorted({f.name for f in fmts}))
    if all(f.handling == "float" for f in fmts):
        report.float_layers[types] = report.float_layers.get(types, 0) + 1
        return None
    if all(f.handling == "exact" and rows is not None for f, (_, rows) in zip(fmts, entries)):  # type: ignore[misc]
        # the file's blocks, cut for this tensor-parallel rank by the layer's own rule (tp_slice)
        parts = [mod.shard_quant_rows(f.rows(rows, src), sid, name)  # type: ignore[misc]
                 for f, (_, rows), (src, sid) in zip(fmts, entries, srcs)]  # type: ignore[misc]
        kind = join_kinds([p.kind for p in parts])
        return QuantWeight.from_rows(QuantRows.cat([p.promote(kind) for p in parts]))
    return QuantWeight.quantize(dense(mod), _requant_kind(name, fmts, types, report), name)


def _requant_kind(name: str, fmts: list, types: str, report: QuantReport) -> int:
    """The kind a layer whose tensors cannot all stay exact is re-quantised to (recorded in the report): a
    float tensor stacked with low-bit ones keeps 8 bits; else the re-quantised types' own target."""
    targets = [QKIND_Q8_0 if f.handling == "float" else f.kind if f.handling == "exact" else f.requant_kind
               for f in fmts]
    want = QKIND_Q8_0 if any(KIND_NAMES[t] != "Q4_1" for t in targets) else QKIND_Q4_1  # type: ignore[index]
    report.requantized.append(f"{name} ({types} -> {KIND_NAMES[want]})")
    report.requantized_by_type.setdefault(types, []).append(name)
    return want


def _plan_experts(name: str, mod: FusedMoE, mode: str,
                  gguf_blocks: dict[str, tuple[str, torch.Tensor | None]] | None, report: QuantReport) -> None:
    """FusedMoE's low-bit copy (ExpertQuantWeight for gate_up and down) by the same rules as a projection's."""
    assert mod.w13 is not None and mod.w2 is not None
    local = range(mod.expert_offset, mod.expert_offset + mod.num_local)
    want: int | None = {"int8": QKIND_Q8_0, "int4": QKIND_Q4_1}.get(mode)
    if want is None:  # auto: the file's own blocks
        assert gguf_blocks is not None
        entries = [gguf_blocks.get(f"{name}.{p}_proj.weight") for p in ("gate", "up", "down")]
        if any(e is None for e in entries):
            return  # not from the file (should not happen): keep float
        fmts = [FORMATS[qt] for qt, _ in entries]  # type: ignore[misc]
        types = "+".join(sorted({f.name for f in fmts}))
        if all(f.handling == "float" for f in fmts):
            report.float_layers[types] = report.float_layers.get(types, 0) + 2
            return
        if all(f.handling == "exact" and rows is not None for f, (_, rows) in zip(fmts, entries)):  # type: ignore[misc]
            def expert_rows(i: int, e: int) -> QuantRows:
                (_, blocks), part = entries[i], ("gate", "up", "down")[i]  # type: ignore[misc]
                src = f"{name}.{part}_proj.weight[{e}]"
                return mod.shard_rows(part, fmts[i].rows(blocks[e], src), src)  # type: ignore[index]

            gate_up = [_joined(expert_rows(0, e), expert_rows(1, e)) for e in local]
            down = [expert_rows(2, e) for e in local]
            _set_experts(mod, gate_up, down, report)
            return
        want = _requant_kind(name, fmts, types, report)
    w13, w2 = mod.w13, mod.w2
    _set_experts(mod, [QuantRows.quantize(w13[e], want, f"{name}.w13[{e}]") for e in range(mod.num_local)],
                 [QuantRows.quantize(w2[e], want, f"{name}.w2[{e}]") for e in range(mod.num_local)], report)


def _joined(a: QuantRows, b: QuantRows) -> QuantRows:
    """gate rows then up rows in the join of their kinds (exact: join_kinds)."""
    kind = join_kinds([a.kind, b.kind])
    return QuantRows.cat([a.promote(kind), b.promote(kind)])


def _set_experts(mod: FusedMoE, gate_up: list[QuantRows], down: list[QuantRows], report: QuantReport) -> None:
    w13 = ExpertQuantWeight.stack([QuantWeight.from_rows(r) for r in gate_up])
    w2 = ExpertQuantWeight.stack([QuantWeight.from_rows(r) for r in down])
    mod.set_low_bit(w13, w2)
    for w in (w13, w2):
        report.counts[w.name] = report.counts.get(w.name, 0) + 1
        report.bytes += w.nbytes()
