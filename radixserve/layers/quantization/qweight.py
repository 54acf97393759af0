"""QuantWeight: one projection's low-bit weights, in the layout the C++ kernels read.

Blocks of 32 along the input dimension (K), as GGUF's legacy formats:
    Q8_0   w = d * q,        q in -127..127
    Q4_1   w = d * q + m,    q in 0..15
Scales are float32 (GGUF stores float16: widening is exact, so weights taken from a GGUF file
represent the file's values bit for bit).

Two layouts:
  QuantRows    row-major values, what formats convert between: q [N, K] (int8 / uint8 values),
               d, m [N, K/32]. Rows of several checkpoint tensors stack here (q/k/v -> qkv).
  QuantWeight  what the kernels read (csrc/quant_linear.h): 8 output rows interleaved per group so one
               32-byte load feeds 8 dot products; N padded with zero rows to a multiple of 8.
                 Q8_0 data int8  [G, nb*256]: (group, block, quarter t<8, row i<8, byte c<4) = element 4t+c
                 Q4_1 data uint8 [G, nb*128]: (group, block, quarter t<4, row i<8, byte c<4) = element
                      8t+c in the low nibble, 8t+4+c in the high one
                 d, m float32    [G, nb*8]:   (group, block, row i)

`QuantRows.from_gguf_blocks` converts GGUF's raw block rows (Q8_0, Q4_0, Q4_1) without loss;
`QuantRows.quantize` makes either format from float weights (int8: absmax / 127 per block; int4:
min/max per block, llama.cpp's Q4_1 rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QBLOCK = 32
QROWS = 8  # rows per interleaved group (csrc/quant_linear.h: kQRows)
QKIND_Q8_0 = 0  # the kernels' kind ids (csrc/quant_linear.h: QKind)
QKIND_Q4_1 = 1
KIND_NAMES = {QKIND_Q8_0: "Q8_0", QKIND_Q4_1: "Q4_1"}

# GGUF block byte sizes of the formats converted exactly
_GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass
class QuantRows:
    kind: int
    q: torch.Tensor  # [N, K]: int8 (Q8_0) or uint8 values 0..15 (Q4_1)
    d: torch.Tensor  # float32 [N, K/32]
    m: torch.Tensor | None = None  # float32 [N, K/32], Q4_1 only

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

    @staticmethod
    def from_gguf_blocks(qtype: str, rows: np.ndarray | torch.Tensor) -> QuantRows:
        """Exact conversion of GGUF block rows (uint8 [N, K/32 * block_bytes]) of Q8_0, Q4_0 or Q4_1."""
        raw = torch.as_tensor(np.array(rows)) if isinstance(rows, np.ndarray) else rows.contiguous()
        bb = _GGUF_BLOCK_BYTES.get(qtype)
        if bb is None:
            raise ValueError(f"no exact conversion from GGUF {qtype}")
        n, row_bytes = raw.shape
        if row_bytes % bb:
            raise ValueError(f"GGUF {qtype} rows of {row_bytes} bytes are not whole {bb}-byte blocks")
        nb = row_bytes // bb
        blocks = raw.view(torch.uint8).reshape(n, nb, bb)
        scale = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, nb).float()
        if qtype == "Q8_0":
            q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, nb * QBLOCK)
            return QuantRows(QKIND_Q8_0, q, scale)
        if qtype == "Q4_1":
            mins = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, nb).float()
            qs = blocks[:, :, 4:]
        else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d), i.e. Q4_1 with m = -8 d (exact in float32)
            mins = -8.0 * scale
            qs = blocks[:, :, 2:]
        # GGUF nibble order: byte j of a block holds element j (low) and j + 16 (high)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, nb * QBLOCK)
        return QuantRows(QKIND_Q4_1, q, scale, mins)

    def narrow(self, dim: int, start: int, length: int, name: str = "weight") -> QuantRows:
        """A tensor-parallel shard: rows (dim 0, output features) or whole 32-blocks of columns (dim 1,
        input features: a row-parallel layer's K split must fall on block boundaries)."""
        if dim == 0:
            return QuantRows(self.kind, self.q[start : start + length], self.d[start : start + length],
                             None if self.m is None else self.m[start : start + length])
        if start % QBLOCK or length % QBLOCK:
            raise ValueError(f"quantization: layer {name} splits its in_features at [{start}, {start + length}) "
                             f"across tensor-parallel ranks, not on the kernels' {QBLOCK}-wide blocks")
        b0, nb = start // QBLOCK, length // QBLOCK
        return QuantRows(self.kind, self.q[:, start : start + length], self.d[:, b0 : b0 + nb],
                         None if self.m is None else self.m[:, b0 : b0 + nb])

    def pad_rows(self, n: int) -> QuantRows:
        """Zero rows up to n (a vocabulary padded to a multiple of tp_size): they compute 0."""
        extra = n - self.q.shape[0]
        if extra <= 0:
            return self

        def z(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, t.shape[1])])

        return QuantRows(self.kind, z(self.q), z(self.d), None if self.m is None else z(self.m))

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """Stack several matrices of the same kind along N (q/k/v into qkv, gate/up into gate_up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights of different kinds {sorted(KIND_NAMES[k] for k in kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
        return QuantRows(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // QBLOCK, QBLOCK) * self.d[:, :, None]
        if self.m is not None:
            w = w + self.m[:, :, None]
        return w.view(n, k)


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

    @staticmethod
    def from_rows(rows: QuantRows) -> QuantWeight:
        n, k = rows.q.shape
        nb, g = k // QBLOCK, -(-n // QROWS)
        pad = g * QROWS - n

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

        def groups(t: torch.Tensor) -> torch.Tensor:  # [Np, nb] -> [G, nb * 8] (group, block, row)
            return padded(t).view(g, QROWS, nb).permute(0, 2, 1).reshape(g, nb * QROWS).contiguous()

        q = padded(rows.q)
        if rows.kind == QKIND_Q8_0:
            data = q.view(g, QROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb * 256).contiguous()
            return QuantWeight(rows.kind, n, k, data, groups(rows.d))
        assert rows.m is not None
        qv = q.view(g, QROWS, nb, 4, 2, 4)  # element 8t + 4h + c
        byte = qv[:, :, :, :, 0, :] | (qv[:, :, :, :, 1, :] << 4)  # [G, i, nb, t, c]
        data = byte.permute(0, 2, 3, 1, 4).reshape(g, nb * 128).contiguous()
        return QuantWeight(rows.kind, n, k, data, groups(rows.d), groups(rows.m))

    @staticmethod
    def quantize(weight: torch.Tensor, kind: int, name: str = "weight") -> QuantWeight:
        return QuantWeight.from_rows(QuantRows.quantize(weight, kind, name))

    def to_rows(self) -> QuantRows:
        """The row-major values again (the inverse of from_rows; tests and dequantize)."""
        n, k = self.n, self.k
        nb, g = k // QBLOCK, self.data.shape[0]

        def ungroup(t: torch.Tensor) -> torch.Tensor:
            return t.view(g, nb, QROWS).permute(0, 2, 1).reshape(g * QROWS, nb)[:n]

        if self.kind == QKIND_Q8_0:
            q = self.data.view(g, nb, 8, QROWS, 4).permute(0, 3, 1, 2, 4).reshape(g * QROWS, k)[:n]
            return QuantRows(self.kind, q, ungroup(self.d))
        assert self.m is not None
        b = self.data.view(g, nb, 4, QROWS, 4)  # [G, nb, t, i, c]
        q = torch.stack([b & 0x0F, b >> 4], dim=4)  # [G, nb, t, i, h, c]
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(g * QROWS, k)[:n]
        return QuantRows(self.kind, q, ungroup(self.d), ungroup(self.m))

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights these blocks represent (the kernels' reference)."""
        return self.to_rows().dequantize()
