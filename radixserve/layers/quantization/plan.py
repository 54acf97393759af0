"""Which low-bit format each projection gets, from `--quantization` and the checkpoint.

    auto   a GGUF file's own precision class, kept packed instead of dequantised:
             Q8_0                      -> Q8_0, the file's values exactly
             Q4_0, Q4_1                -> Q4_1, exactly (Q4_0's w = d(q - 8) is Q4_1 with m = -8d)
             Q6_K                      -> Q8_0 re-quantised from the dequantised weights (one log line)
             Q2_K..Q5_K, Q5_0, Q5_1    -> Q4_1 re-quantised from the dequantised weights (one log line)
             F32, F16, BF16            -> float (no low-bit copy)
           a Hugging Face folder: float, no low-bit copy.
    int8   every projection and the LM head quantised to Q8_0 at load (absmax per 32-block)
    int4   every projection and the LM head quantised to Q4_1 at load (min/max per 32-block)
    none   float only (the exact mode)

The low-bit copy is what every step uses on a CPU whose float GEMMs would be float32 (the float copies are
then released), and steps of up to ModelRunner.quant_max_rows rows where they are bf16 (AMX wins the
long, compute-bound ones); layers/linear.py: resolve_low_bit_max_rows. A projection
stacked from several checkpoint tensors (q/k/v, gate/up) takes the larger format when they differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.layers.quantization.qweight import KIND_NAMES, QKIND_Q4_1, QKIND_Q8_0, QuantRows, QuantWeight
from radixserve.server_args import QUANTIZATION_MODES

logger = logging.getLogger(__name__)

_EXACT = {"Q8_0": QKIND_Q8_0, "Q4_0": QKIND_Q4_1, "Q4_1": QKIND_Q4_1}
_FLOAT = frozenset({"F32", "F16", "BF16"})
_TO_Q8 = frozenset({"Q6_K"})  # more than 4.5 bits per weight: keep 8


@dataclass
class QuantReport:
    """What a plan did: per format the number of layers, and the layers re-quantised."""

    counts: dict[str, int] = field(default_factory=dict)
    requantized: list[str] = field(default_factory=list)
    bytes: int = 0

    def summary(self) -> str:
        parts = [f"{n} x {k}" for k, n in sorted(self.counts.items())]
        return ", ".join(parts) or "no low-bit layers"


def _target_kind(qtype: str) -> int | None:
    if qtype in _FLOAT:
        return None
    if qtype in _EXACT:
        return _EXACT[qtype]
    return QKIND_Q8_0 if qtype in _TO_Q8 else QKIND_Q4_1


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
    from radixserve.layers.linear import PackableLinear

    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    report = QuantReport()
    if mode == "none" or (mode == "auto" and gguf_blocks is None):
        return report
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, PackableLinear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        qw = _plan_one(name, mod, mode, sources(name), dense, gguf_blocks, report)
        mod.qweight = qw
        if qw is not None:
            report.counts[qw.name] = report.counts.get(qw.name, 0) + 1
            report.bytes += qw.nbytes()
    if report.requantized:
        logger.info("quantization auto: %d layers have no exact packed kernel and were re-quantised "
                    "(first: %s)", len(report.requantized), report.requantized[0])
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
    kinds = [_target_kind(qt) for qt, _ in entries]  # type: ignore[misc]
    if all(k is None for k in kinds):
        return None
    want = QKIND_Q8_0 if QKIND_Q8_0 in kinds or None in kinds else QKIND_Q4_1
    exact = all(rows is not None and _EXACT.get(qt) == want for qt, rows in entries)  # type: ignore[misc]
    if exact:
        # the file's blocks, cut for this tensor-parallel rank by the layer's own rule (tp_slice)
        parts = [mod.shard_quant_rows(QuantRows.from_gguf_blocks(qt, rows), sid, name)  # type: ignore[misc]
                 for (qt, rows), (_, sid) in zip(entries, srcs)]  # type: ignore[misc]
        return QuantWeight.from_rows(QuantRows.cat(parts))
    types = "+".join(sorted({qt for qt, _ in entries}))  # type: ignore[misc]
    logger.info("quantization auto: %s (%s) has no exact packed kernel: re-quantised to %s",
                name, types, KIND_NAMES[want])
    report.requantized.append(f"{name} ({types} -> {KIND_NAMES[want]})")
    return QuantWeight.quantize(dense(mod), want, name)
