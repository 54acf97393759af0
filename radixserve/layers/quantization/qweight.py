"""QuantWeight: one projection's low-bit weights, in the layout the C++ kernels read.

Blocks of 32 along the input dimension (K). The kernel kinds (KINDS; csrc/quant_linear.h: QKind):
    Q8_0    w = d * q,        q int8,   d per 32
    Q4_1    w = d * q + m,    q 0..15,  d, m per 32
    Q5      w = d * q + m,    q 0..31,  d, m per 32 (Q4_1's nibbles plus a plane of fifth bits)
    Q8_M    w = d * q + m,    q int8,   d, m per 32
    Q8_16   w = d * q,        q int8,   d per 16 (two scales per 32-block)
    Q8_M16  w = d * q + m,    q int8,   d, m per 16
    Q6      w = d * q,        q -32..31, d per 16 (Q6_K: Q4_1's nibbles of q + 32 plus a plane of top bits)
Scales are float32: every GGUF format in gguf_formats.py maps onto one of these kinds with float32
products that equal `gguf.quants.dequantize` exactly (its scales are float16 products of small ints).
A kind "covers" another when it represents every weight of it with the same float32 operations
(join_kinds): stacked projections of different kinds (q/k Q4_K, v Q6_K) take the join, exactly.

Two layouts:
  QuantRows    row-major values, what formats convert between: q [N, K] (int8, or uint8 for Q4_1 / Q5),
               d, m [N, K / group]. Rows of several checkpoint tensors stack here (q/k/v -> qkv).
  QuantWeight  what the kernels read (csrc/quant_linear.h): 8 output rows interleaved per group so one
               32-byte load feeds 8 dot products; N padded with zero rows to a multiple of 8.
                 8-bit data int8  [G, nb*256]: (group, block, quarter t<8, row i<8, byte c<4) = element 4t+c
                 Q4_1 data uint8  [G, nb*128]: (group, block, quarter t<4, row i<8, byte c<4) = element
                      8t+c in the low nibble, 8t+4+c in the high one
                 Q5   data uint8  [G, nb*160]: per block Q4_1's 128 bytes of low nibbles, then 32 bytes of
                      fifth bits (row i<8, byte c<4): bit 2t = element 8t+c, bit 2t+1 = element 8t+4+c,
                      so the fifth bits of a nibble byte sit in the byte at the same lane position
                 Q6   data uint8  [G, nb*192]: per block Q4_1's 128 bytes of the low 4 bits of q + 32,
                      then two 32-byte planes p < 2 of top bits (row i<8, byte c<4): bits 4(t-2p) + 2h
                      and the next hold bits 4-5 of element 8t+4h+c (t = 2p, 2p+1)
                 d, m float32     [G, nb*S*8]: (group, block, sub-block s<S, row i), S = 32 / group;
                      float16 where every value is one (_half_if_exact: the legacy types' file scales),
                      or factored (uint8 records: a K-quant's super-scale x int8 sub-scales, the same
                      float32 products at a quarter of the bytes; scale_factors.py)

`gguf_formats.FORMATS[qtype].rows(raw)` converts GGUF's raw block rows without loss;
`QuantRows.quantize` makes Q8_0 or Q4_1 from float weights (int8: absmax / 127 per block; int4:
min/max per block, llama.cpp's Q4_1 rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.quantization.expert_slab import stacked
from radixserve.layers.quantization.scale_factors import ScaleFactors

QBLOCK = 32
QROWS = 8  # rows per interleaved group (csrc/quant_linear.h: kQRows)


@dataclass(frozen=True)
class KernelKind:
    """One weight layout the C++ kernels multiply (the id is csrc/quant_linear.h's QKind)."""

    id: int
    name: str
    group: int  # elements per scale (and min): 32 or 16
    has_min: bool
    bits: int  # 4, 5, 6 (packed: low nibbles two per byte, then planes of high bits) or 8 (one int8 a byte)

    @property
    def packed(self) -> bool:
        return self.bits < 8

    @property
    def unsigned(self) -> bool:
        """Values 0..2^bits - 1 with a min (Q4_1, Q5); the others are signed int8 values."""
        return self.bits in (4, 5)

    @property
    def row_dtype(self) -> torch.dtype:
        return torch.uint8 if self.unsigned else torch.int8

    @property
    def block_bytes(self) -> int:
        """Data bytes of one 32-block of an 8-row group."""
        return 8 * 32 * self.bits // 8

    @property
    def activation(self) -> str:
        """What the activations are quantised to: int8 per 32 with their scale, plus d * sum(q) per
        scale group for a kind with mins (the min term's activation sums)."""
        if not self.has_min:
            return "q8 per 32"
        return f"q8 per 32 + sums per {self.group}"


QKIND_Q8_0, QKIND_Q4_1, QKIND_Q8_M, QKIND_Q8_16, QKIND_Q8_M16, QKIND_Q5, QKIND_Q6 = range(7)
KINDS: dict[int, KernelKind] = {k.id: k for k in (
    KernelKind(QKIND_Q8_0, "Q8_0", 32, has_min=False, bits=8),
    KernelKind(QKIND_Q4_1, "Q4_1", 32, has_min=True, bits=4),
    KernelKind(QKIND_Q8_M, "Q8_M", 32, has_min=True, bits=8),
    KernelKind(QKIND_Q8_16, "Q8_16", 16, has_min=False, bits=8),
    KernelKind(QKIND_Q8_M16, "Q8_M16", 16, has_min=True, bits=8),
    KernelKind(QKIND_Q5, "Q5", 32, has_min=True, bits=5),
    KernelKind(QKIND_Q6, "Q6", 16, has_min=False, bits=6),
)}
KIND_NAMES = {k.id: k.name for k in KINDS.values()}


def join_kinds(kinds: list[int]) -> int:
    """The smallest kind that holds every weight of `kinds` exactly: the kind if all are one, Q5 if all
    are unsigned (0..15 is a 5-bit value, same d and m), else 8-bit with a min if any has one and the finer
    scale group (int8 holds 0..31 and Q6's -32..31; m = 0 and a scale repeated per 16 give the same
    float32 products)."""
    if len(set(kinds)) == 1:
        return kinds[0]
    ks = [KINDS[k] for k in kinds]
    if all(k.unsigned for k in ks):
        return QKIND_Q5
    has_min, group = any(k.has_min for k in ks), min(k.group for k in ks)
    return next(k.id for k in KINDS.values() if k.bits == 8 and k.has_min == has_min and k.group == group)


@dataclass
class QuantRows:
    kind: int
    q: torch.Tensor  # [N, K]: int8, or uint8 values 0..15 (Q4_1) / 0..31 (Q5); Q6: int8 -32..31
    d: torch.Tensor  # float32 [N, K / group]
    m: torch.Tensor | None = None  # float32 [N, K / group], kinds with a min only
    factors: ScaleFactors | None = None  # d and m as two-level products, where the format has them

    @staticmethod
    def quantize(weight: torch.Tensor, kind: int, name: str = "weight") -> QuantRows:
        """Quantise float weights [N, K] (K a multiple of 32) to `kind`."""
        if weight.dim() != 2:
            raise ValueError(f"quantization: layer {name} has a {weight.dim()}-d weight, expected [out, in]")
        n, k = weight.shape
        if k % QBLOCK:
            raise ValueError(f"quantization: layer {name} has in_features {k} (weight {n}x{k}), not a multiple "
                             f"of the kernels' {QBLOCK}-wide blocks")
        w = weight.detach().float().reshape(n, k // QBLOCK, QBLOCK)
        if kind == QKIND_Q8_0:
            d = (w.abs().amax(dim=2) / 127.0).clamp(min=1e-12)
            q = torch.round(w / d[:, :, None]).clamp(-127, 127).to(torch.int8)
            return QuantRows(kind, q.reshape(n, k), d)
        if kind != QKIND_Q4_1:
            raise ValueError(f"quantization: unknown kind {kind}")
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        d = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((w - lo[:, :, None]) / d[:, :, None]).clamp(0, 15).to(torch.uint8)
        return QuantRows(kind, q.reshape(n, k), d, lo)

    @property
    def group(self) -> int:
        return KINDS[self.kind].group

    def promote(self, kind: int) -> QuantRows:
        """The same weights in `kind` (which must cover this one: join_kinds), value for value."""
        if kind == self.kind:
            return self
        if join_kinds([self.kind, kind]) != kind:
            raise ValueError(f"kind {KIND_NAMES[kind]} cannot hold {KIND_NAMES[self.kind]} weights exactly")
        rep = self.group // KINDS[kind].group
        d = self.d.repeat_interleave(rep, dim=1)
        m = self.m.repeat_interleave(rep, dim=1) if self.m is not None else None
        if KINDS[kind].has_min and m is None:
            m = torch.zeros_like(d)
        f = None if self.factors is None else self.factors.promote(rep, KINDS[kind].has_min)
        return QuantRows(kind, self.q.to(KINDS[kind].row_dtype), d, m, f)

    def narrow(self, dim: int, start: int, length: int, name: str = "weight") -> QuantRows:
        """A tensor-parallel shard: rows (dim 0, output features) or whole 32-blocks of columns (dim 1,
        input features: a row-parallel layer's K split must fall on block boundaries)."""
        f = None if self.factors is None else self.factors.narrow(dim, start, length, self.group)
        if dim == 0:
            return QuantRows(self.kind, self.q[start : start + length], self.d[start : start + length],
                             None if self.m is None else self.m[start : start + length], f)
        if start % QBLOCK or length % QBLOCK:
            raise ValueError(f"quantization: layer {name} splits its in_features at [{start}, {start + length}) "
                             f"across tensor-parallel ranks, not on the kernels' {QBLOCK}-wide blocks")
        b0, nb = start // self.group, length // self.group
        return QuantRows(self.kind, self.q[:, start : start + length], self.d[:, b0 : b0 + nb],
                         None if self.m is None else self.m[:, b0 : b0 + nb], f)

    def pad_rows(self, n: int) -> QuantRows:
        """Zero rows up to n (a vocabulary padded to a multiple of tp_size): they compute 0."""
        extra = n - self.q.shape[0]
        if extra <= 0:
            return self

        def z(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, t.shape[1])])

        return QuantRows(self.kind, z(self.q), z(self.d), None if self.m is None else z(self.m),
                         None if self.factors is None else self.factors.pad_rows(extra))

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """Stack several matrices of the same kind along N (q/k/v into qkv, gate/up into gate_up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights of different kinds {sorted(KIND_NAMES[k] for k in kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
        return QuantRows(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m,
                         ScaleFactors.cat([p.factors for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.group, self.group) * self.d[:, :, None]
        if self.m is not None:
            w = w + self.m[:, :, None]
        return w.view(n, k)


def _half_if_exact(d: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and mins) as float16 where every one of them is a float16 value: the file's own scales for the
    legacy GGUF types, which then stream 2 bytes a scale instead of 4 (a Q4_1 weight 5 bits, not 6) while the
    kernels widen them to the same float32 (F16C's conversion is exact). Otherwise float32, as before."""
    h = d.half()
    if not torch.equal(h.float(), d):
        return d, m
    if m is None:
        return h, None
    hm = m.half()
    return (h, hm) if torch.equal(hm.float(), m) else (d, m)


def _one_dtype(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pieces' scales to join: float16 only if every piece has them so (else float32, the same values)."""
    if len({t.dtype for t in scales}) > 1:
        return [t.float() if t.dtype == torch.float16 else t for t in scales]
    return scales


@dataclass
class QuantWeight:
    kind: int
    n: int  # output rows (before padding)
    k: int
    data: torch.Tensor  # interleaved, see the module docstring
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.d, self.m) if t is not None)

    @property
    def factored(self) -> bool:
        return self.d.dtype == torch.uint8

    @staticmethod
    def from_rows(rows: QuantRows) -> QuantWeight:
        n, k = rows.q.shape
        nb, g = k // QBLOCK, -(-n // QROWS)
        pad = g * QROWS - n

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

        def groups(t: torch.Tensor) -> torch.Tensor:  # [Np, S] -> [G, S * 8] (group, block, sub-block, row)
            s = t.shape[1]
            return padded(t).view(g, QROWS, s).permute(0, 2, 1).reshape(g, s * QROWS).contiguous()

        kk = KINDS[rows.kind]
        if kk.has_min != (rows.m is not None):
            raise ValueError(f"{kk.name} rows {'need' if kk.has_min else 'have no'} mins")
        q = padded(rows.q)
        d, m = groups(rows.d), groups(rows.m) if rows.m is not None else None
        if rows.factors is not None:
            d = rows.factors.records("d", g)
            m = rows.factors.records("m", g) if m is not None else None
        else:
            d, m = _half_if_exact(d, m)
        if not kk.packed:
            data = q.view(g, QROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb * 256).contiguous()
            return QuantWeight(rows.kind, n, k, data, d, m)
        if kk.bits == 6:
            q = (q.to(torch.int16) + 32).to(torch.uint8)  # -32..31 -> 0..63: nibbles as Q4_1's, top bits
        qv = q.view(g, QROWS, nb, 4, 2, 4)  # element 8t + 4h + c
        low = qv & 0x0F
        byte = low[:, :, :, :, 0, :] | (low[:, :, :, :, 1, :] << 4)  # [G, i, nb, t, c]
        data = byte.permute(0, 2, 3, 1, 4).reshape(g, nb, 128)
        if kk.bits == 5:
            shift = torch.arange(8, dtype=torch.uint8).view(4, 2, 1)  # bit 2t + h
            high = ((qv >> 4) << shift).sum(dim=(3, 4), dtype=torch.uint8)  # [G, i, nb, c]
            data = torch.cat([data, high.permute(0, 2, 1, 3).reshape(g, nb, 32)], dim=2)
        if kk.bits == 6:
            top = (qv >> 4).view(g, QROWS, nb, 2, 2, 2, 4)  # [G, i, nb, p, t - 2p, h, c]
            shift = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(2, 2, 1)  # bits 4(t - 2p) + 2h
            planes = (top << shift).sum(dim=(4, 5), dtype=torch.uint8)  # [G, i, nb, p, c]
            data = torch.cat([data, planes.permute(0, 2, 3, 1, 4).reshape(g, nb, 64)], dim=2)
        data = data.reshape(g, nb * kk.block_bytes).contiguous()
        return QuantWeight(rows.kind, n, k, data, d, m)

    @staticmethod
    def quantize(weight: torch.Tensor, kind: int, name: str = "weight") -> QuantWeight:
        return QuantWeight.from_rows(QuantRows.quantize(weight, kind, name))

    @staticmethod
    def cat_groups(pieces: list[QuantWeight]) -> QuantWeight:
        """Stack weights packed from consecutive row ranges (each but the last a multiple of QROWS rows, so no
        padding inside) into one: the groups are independent, so this equals packing all the rows at once."""
        if len(pieces) == 1:
            return pieces[0]
        first = pieces[0]
        for p in pieces[:-1]:
            if p.n % QROWS:
                raise ValueError(f"a piece of {p.n} rows is not whole {QROWS}-row groups")
        m = None if first.m is None else torch.cat(_one_dtype([p.m for p in pieces if p.m is not None]))
        return QuantWeight(first.kind, sum(p.n for p in pieces), first.k, torch.cat([p.data for p in pieces]),
                           torch.cat(_one_dtype([p.d for p in pieces])), m)

    def to_rows(self) -> QuantRows:
        """The row-major values again (the inverse of from_rows; tests and dequantize)."""
        n, k = self.n, self.k
        nb, g = k // QBLOCK, self.data.shape[0]

        kk = KINDS[self.kind]

        def ungroup(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.uint8:
                return ScaleFactors.flat_from_records(t, n, k, kk.group)
            s = t.shape[1] // QROWS
            return t.float().view(g, s, QROWS).permute(0, 2, 1).reshape(g * QROWS, s)[:n]

        if not kk.packed:
            q = self.data.view(g, nb, 8, QROWS, 4).permute(0, 3, 1, 2, 4).reshape(g * QROWS, k)[:n]
            return QuantRows(self.kind, q, ungroup(self.d), None if self.m is None else ungroup(self.m))
        blocks = self.data.view(g, nb, kk.block_bytes)
        b = blocks[:, :, :128].reshape(g, nb, 4, QROWS, 4)  # [G, nb, t, i, c]
        q = torch.stack([b & 0x0F, b >> 4], dim=4)  # [G, nb, t, i, h, c]
        if kk.bits == 5:
            hb = blocks[:, :, 128:].reshape(g, nb, 1, 1, QROWS, 4)  # [G, nb, -, -, i, c]
            shift = torch.arange(8, dtype=torch.uint8).view(4, 2, 1, 1)  # bit 2t + h
            q = q | (((hb >> shift) & 1) << 4).permute(0, 1, 2, 4, 3, 5)
        if kk.bits == 6:
            planes = blocks[:, :, 128:].reshape(g, nb, 2, QROWS, 4).repeat_interleave(2, dim=2)  # [G, nb, t, i, c]
            shift = torch.tensor([[0, 2], [4, 6], [0, 2], [4, 6]], dtype=torch.uint8).view(1, 1, 4, 1, 2, 1)
            q = q | (((planes[:, :, :, :, None, :] >> shift) & 3) << 4)
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(g * QROWS, k)[:n]
        if kk.bits == 6:
            q = (q.to(torch.int16) - 32).to(torch.int8)
        return QuantRows(self.kind, q, ungroup(self.d), None if self.m is None else ungroup(self.m))

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights these blocks represent (the kernels' reference)."""
        return self.to_rows().dequantize()


@dataclass
class ExpertQuantWeight:
    """One projection of every expert a MoE layer holds, stacked for csrc/fused_experts.cpp: row e of
    data / d / m is expert e's QuantWeight tensors flattened (same kind and shape for every expert: a
    GGUF's 3-D expert tensor has one type)."""

    kind: int
    n: int
    k: int
    data: torch.Tensor  # [experts, one expert's data numel]
    d: torch.Tensor  # float32 / float16 / factored uint8 [experts, one expert's scales], as QuantWeight's
    m: torch.Tensor | None = None

    @staticmethod
    def stack(weights: list[QuantWeight]) -> ExpertQuantWeight:
        first = weights[0]
        for w in weights:
            if (w.kind, w.n, w.k) != (first.kind, first.n, first.k):
                raise ValueError(f"experts of one projection differ: {w.name} {w.n}x{w.k} vs "
                                 f"{first.name} {first.n}x{first.k}")
        m = stacked(_one_dtype([w.m for w in weights])) if first.m is not None else None  # type: ignore[misc]
        return ExpertQuantWeight(first.kind, first.n, first.k, stacked([w.data for w in weights]),
                                 stacked(_one_dtype([w.d for w in weights])), m)

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    def expert(self, e: int) -> QuantWeight:
        """Expert e's blocks as a QuantWeight (views; tests and the reference)."""
        g = -(-self.n // QROWS)
        return QuantWeight(self.kind, self.n, self.k, self.data[e].view(g, -1), self.d[e].view(g, -1),
                           None if self.m is None else self.m[e].view(g, -1))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.d, self.m) if t is not None)
