"""Every GGUF tensor type radixserve loads, one record each: the one list the loader (which types a file
may hold), the planner (what each becomes), the TP slicer and the kernels (through the kind) read.

    float    F32, F16, BF16: no low-bit copy; dequantised to float32 (F16 / BF16 widen exactly) and run
             on the float GEMMs (bf16 where the CPU has them, layers/linear.py)
    exact    the file's blocks become one kernel kind (qweight.KINDS) without loss: each weight the
             kernel uses equals `gguf.quants.dequantize` of its block, bit for bit (tests/layers/
             test_gguf_formats.py checks it on random blocks and on a real file)
    requant  gguf can dequantise it but no kernel kind holds it exactly (IQ1/IQ2/IQ3 grids, ternary,
             FP4): the dequantised weights are re-quantised to `requant_kind`, one log line per type

Why each exact mapping is exact: GGUF scales are float16 (11 significant bits) and the sub-scales, mins
and values are small ints, so every product gguf forms (d * sc, (d * sc) * q, dmin * m) needs at most 24
significant bits and is exact in float32, whatever the order; the one rounding step, "d * q - dm", is
the same float32 operation in the kernel's "d' * q + m'" with m' = -dm. So:
    Q8_0     Q8_0    d, q
    Q5_0     Q5      d, q (0..31), m = -16 d
    IQ4_NL   Q8_0    d, kvalues[q] (the table is int8)
    IQ4_XS   Q8_0    d * (ls - 32) per 32, kvalues[q]
    Q3_K     Q8_0    -d per 32, -(sc - 32) * q: 16-element sub-scales folded into the ints (-128..124;
                     negated because +128 = (-32) * (-4) does not fit int8 and -128 does)
    Q4_0     Q4_1    d, q, m = -8 d
    Q4_1     Q4_1    d, q, m
    Q4_K     Q4_1    d * sc, q, -(dmin * mn) per 32
    Q5_1     Q5      d, q (0..31), m
    Q5_K     Q5      d * sc, q (0..31), -(dmin * mn) per 32
    Q6_K     Q6      d * sc per 16, q - 32 (6 bits: its integer sums are Q8_16's, value for value)
    Q2_K     Q8_M16  d * sc per 16, q (0..3), -(dmin * mn) per 16
The K-quants (and IQ4_XS) also give their scales as factors, d per 256 times the small-int sub-scale
(scale_factors.py): the kernels then read the file's factors and form the same float32 products, so Q4_K
streams 4.75 bits a weight instead of the flat products' 6, Q6_K (as Q6) 6.6 instead of 10 as Q8_16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from radixserve.layers.quantization.qweight import (
    KINDS,
    QKIND_Q4_1,
    QKIND_Q5,
    QKIND_Q6,
    QKIND_Q8_0,
    QKIND_Q8_M16,
    QuantRows,
)
from radixserve.layers.quantization.scale_factors import ScaleFactors

# blocks uint8 [B, block_bytes] -> (q [B, block_size] int, d [B, block_size / group] float32, m or None)
Converter = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]

# blocks -> the two-level factors of the same scales (scale_factors.py): d_super [B, 1], d_sub [B, 256 / group]
# (small ints), m_super, m_sub or None; d == d_super * d_sub exactly (checked when the rows are built)
Factors = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]]

# IQ4_NL / IQ4_XS's non-linear 4-bit grid (ggml's kvalues_iq4nl; gguf.quants.IQ4_NL.kvalues)
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, widened (exactly) to float32, as a column [B, 1]."""
    return b[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_split16(qs: np.ndarray) -> np.ndarray:
    """Legacy 32-blocks: byte j holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(word_bytes: np.ndarray, n: int) -> np.ndarray:
    """Bit i (i < n) of each block's little-endian bit field, [B, n] of 0/1."""
    return np.unpackbits(word_bytes, axis=1, bitorder="little")[:, :n]


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit values: 32-byte chunk c holds elements 64c + j (low) and 64c + 32 + j (high)."""
    b = qs.shape[0]
    q = qs.reshape(b, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(b, -1)


def _k_scale_min(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 8 six-bit scales and mins from 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7."""
    lo, hi, mix = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray):
    return b[:, 2:34].copy().view(np.int8), _f16(b, 0), None


def _q4_0(b: np.ndarray):
    d = _f16(b, 0)
    return _nibbles_split16(b[:, 2:18]), d, -8.0 * d  # d (q - 8) = d q + (-8 d), both exact


def _q4_1(b: np.ndarray):
    return _nibbles_split16(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray):
    q = _nibbles_split16(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    d = _f16(b, 0)
    return q, d, -16.0 * d  # d (q - 16) = d q + (-16 d), both exact (as Q4_0's -8 d)


def _q5_1(b: np.ndarray):
    q = _nibbles_split16(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return q, _f16(b, 0), _f16(b, 2)


def _iq4_nl(b: np.ndarray):
    return IQ4_GRID[_nibbles_split16(b[:, 2:18])], _f16(b, 0), None


def _iq4_xs_ls(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    lo = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & 0x0F
    hi = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & 0x03
    return (lo | (hi << 4)).astype(np.float32) - 32.0


def _iq4_xs(b: np.ndarray):
    n = b.shape[0]
    # sub-block i: 16 bytes, element j (low nibble) and 16 + j (high)
    idx = (b[:, 8:136].reshape(n, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return IQ4_GRID[idx.reshape(n, 256)], _f16(b, 0) * _iq4_xs_ls(b), None


def _q4_k(b: np.ndarray):
    sc, mn = _k_scale_min(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k(b: np.ndarray):
    sc, mn = _k_scale_min(b[:, 4:16])
    n = b.shape[0]
    # bit s of qh byte j is the fifth bit of element 32 s + j
    hb = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _k_nibbles(b[:, 48:176]) | (hb.reshape(n, 256) << 4)
    return q, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q6_k(b: np.ndarray):
    n = b.shape[0]
    # 64-byte chunk h of ql: element 128 h + j (low nibble) and 128 h + 64 + j (high), j < 64
    lo = (b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    # 32-byte chunk h of qh: bits 2s..2s+1 of byte j are the top of element 128 h + 32 s + j
    hi = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (lo.reshape(n, 256) | (hi.reshape(n, 256) << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, _f16(b, 208) * sc, None


def _k_factors(b: np.ndarray):  # Q4_K, Q5_K: d x sc, -dmin x mn per 32
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b, 0), sc, -_f16(b, 2), mn


def _q6_k_factors(b: np.ndarray):
    return _f16(b, 208), b[:, 192:208].copy().view(np.int8), None, None


def _two_bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K low bits: 32-byte chunk h, bits 2s..2s+1 of byte j = element 128 h + 32 s + j."""
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & 0x03).reshape(n, 256)


def _q2_k(b: np.ndarray):
    sc = b[:, 0:16]
    return (_two_bit(b[:, 16:80]).astype(np.int8), _f16(b, 80) * (sc & 0x0F).astype(np.float32),
            -(_f16(b, 82) * (sc >> 4).astype(np.float32)))


def _q3_k(b: np.ndarray):
    n = b.shape[0]
    # bit s of hmask byte j set = element 32 s + j has no -4 offset
    hb = (b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _two_bit(b[:, 32:96]).astype(np.int16) - 4 * (1 - hb.reshape(n, 256).astype(np.int16))
    s = b[:, 96:108]
    lo = (s[:, 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 0x0F
    hi = (s[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 0x03
    sc = (lo | (hi << 4)).astype(np.int16) - 32
    folded = -(np.repeat(sc, 16, axis=1) * q)  # -128..124
    return folded.astype(np.int8), np.repeat(-_f16(b, 108), 8, axis=1), None


def _q2_k_factors(b: np.ndarray):
    return _f16(b, 80), b[:, 0:16] & 0x0F, -_f16(b, 82), b[:, 0:16] >> 4


def _q3_k_factors(b: np.ndarray):  # one scale per 256 (the sub-scales live in the ints)
    return -_f16(b, 108), np.ones((b.shape[0], 8), dtype=np.int8), None, None


def _iq4_xs_factors(b: np.ndarray):
    return _f16(b, 0), _iq4_xs_ls(b), None, None


@dataclass(frozen=True)
class GGUFFormat:
    """One GGUF tensor type."""

    qtype: QType
    handling: str  # "float" | "exact" | "requant"
    kind: int | None = None  # exact: the kernel kind its blocks become
    convert: Converter | None = None  # exact: blocks -> kind values
    requant_kind: int | None = None  # requant: what the dequantised weights are quantised to
    factors: Factors | None = None  # exact K-quants: their scales as two-level factors (fewer bytes)

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block_size(self) -> int:  # elements per block
        return gguf.GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.qtype][1]

    @property
    def activation(self) -> str:
        """The activation format its kernel multiplies with ("float" on the float path)."""
        kind = self.kind if self.handling == "exact" else self.requant_kind
        return "float" if kind is None else KINDS[kind].activation

    def kernel_bytes(self, numel: int, float_bytes: int = 4, file_scales: bool = True) -> int:
        """Bytes `numel` weights of this type take in the kernels' layout (QuantWeight: the data planes, then
        scales and mins per group, or their factored records where the format has factors); float types take
        `float_bytes` a value. The memory budget's estimate before anything is loaded. `file_scales`: the
        file's own blocks are kept, so a legacy type's float16 scales stay 2 bytes (qweight._half_if_exact);
        False for blocks quantised at load from float weights (float32 scales)."""
        exact = self.handling == "exact"
        kind = self.kind if exact else self.requant_kind
        if kind is None:
            return numel * float_bytes
        kk = KINDS[kind]
        if self.factors is not None:
            per_group = (4 + 256 // kk.group) / (256 // kk.group)
        else:
            per_group = 2.0 if exact and file_scales else 4.0
        scale_bytes = per_group * (2 if kk.has_min else 1) * numel / kk.group
        return int(numel * kk.bits / 8 + scale_bytes)

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """The exact mode's float32 values of raw blocks (gguf's reference)."""
        return gguf.quants.dequantize(raw, self.qtype).astype(np.float32, copy=False)

    def rows(self, raw: np.ndarray | torch.Tensor, name: str = "weight") -> QuantRows:
        """Raw block rows uint8 [N, K / block_size * block_bytes] as kernel rows, without loss."""
        if self.convert is None or self.kind is None:
            raise ValueError(f"GGUF {self.name} has no exact kernel layout")
        raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        n, row_bytes = raw.shape
        if row_bytes % self.block_bytes:
            raise ValueError(f"GGUF tensor {name} ({self.name}): rows of {row_bytes} bytes are not whole "
                             f"{self.block_bytes}-byte blocks")
        nb = row_bytes // self.block_bytes
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * nb, self.block_bytes)
        q, d, m = self.convert(blocks)
        k = nb * self.block_size

        def t(a: np.ndarray | None, dtype=np.float32) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a.astype(dtype)).reshape(n, -1))

        qt, dt, mt = t(q, np.uint8 if KINDS[self.kind].unsigned else np.int8), t(d), t(m)
        assert qt is not None and dt is not None and qt.shape[1] == k and dt.shape[1] == k // KINDS[self.kind].group
        factors = None
        if self.factors is not None:
            ds, dsub, ms, msub = self.factors(blocks)
            factors = ScaleFactors.verified(dt, mt, t(ds), t(dsub, np.int8), t(ms), t(msub, np.int8))  # type: ignore[arg-type]
        return QuantRows(self.kind, qt, dt, mt, factors)


def _exact(qtype: QType, kind: int, convert: Converter, factors: Factors | None = None) -> GGUFFormat:
    return GGUFFormat(qtype, "exact", kind=kind, convert=convert, factors=factors)


def _requant(name: str) -> list[GGUFFormat]:
    # every re-quantised type has at most ~4.25 bits per weight: Q4_1 keeps as much
    qtype = getattr(QType, name, None)
    return [] if qtype is None else [GGUFFormat(qtype, "requant", requant_kind=QKIND_Q4_1)]


FORMATS: dict[str, GGUFFormat] = {f.name: f for f in [
    GGUFFormat(QType.F32, "float"), GGUFFormat(QType.F16, "float"), GGUFFormat(QType.BF16, "float"),
    _exact(QType.Q8_0, QKIND_Q8_0, _q8_0),
    _exact(QType.Q4_0, QKIND_Q4_1, _q4_0),
    _exact(QType.Q4_1, QKIND_Q4_1, _q4_1),
    _exact(QType.Q5_0, QKIND_Q5, _q5_0),
    _exact(QType.Q5_1, QKIND_Q5, _q5_1),
    _exact(QType.Q2_K, QKIND_Q8_M16, _q2_k, _q2_k_factors),
    _exact(QType.Q3_K, QKIND_Q8_0, _q3_k, _q3_k_factors),
    _exact(QType.Q4_K, QKIND_Q4_1, _q4_k, _k_factors),
    _exact(QType.Q5_K, QKIND_Q5, _q5_k, _k_factors),
    _exact(QType.Q6_K, QKIND_Q6, _q6_k, _q6_k_factors),
    _exact(QType.IQ4_NL, QKIND_Q8_0, _iq4_nl),
    _exact(QType.IQ4_XS, QKIND_Q8_0, _iq4_xs, _iq4_xs_factors),
    *[f for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0",
                  "MXFP4", "NVFP4") for f in _requant(n)],
]}

# what the loader accepts: every type above (dequantised through gguf for the float weights)
SUPPORTED_TENSOR_TYPES: frozenset[QType] = frozenset(f.qtype for f in FORMATS.values())
EXACT_TYPES: frozenset[str] = frozenset(n for n, f in FORMATS.items() if f.handling == "exact")
FLOAT_TYPES: frozenset[str] = frozenset(n for n, f in FORMATS.items() if f.handling == "float")


def gguf_format(qtype: QType | str) -> GGUFFormat | None:
    return FORMATS.get(qtype if isinstance(qtype, str) else qtype.name)
