"""ScaleFactors: the K-quants' two-level scales, kept as the file holds them.

A Q4_K super-block of 256 weights has one float16 scale `d` (and `dmin`) and eight 6-bit sub-scales (and
mins); the kernel's scale of sub-block s is the float32 product `d * sc[s]`, exact (11 x 6 significant
bits). Storing that product as a float32 per 32 weights costs 1 bit a weight for the scale and 1 for the
min, a third of Q4_K's 4.5; storing the factors costs 0.25 + 0.125 each. So a format that factors
(gguf_formats.py: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) hands its rows these factors beside the flat
products, and QuantWeight lays them out as the kernels' factored records (csrc/quant_linear.h):

    d = d_super[:, j] * d_sub[:, s]   for scale group s of super-block j (256 elements), bit for bit,
    m = m_super[:, j] * m_sub[:, s]   (kinds with a min; zero factors where a promoted kind gains one)

Every rule that changes rows (narrow, pad, cat, promote) keeps the factors where it can and drops them
where it cannot (a K split off the 256 boundaries, parts without factors): the flat scales are always
there and always exact, so dropping costs bytes, never values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPER = 256  # elements per super-scale
QROWS = 8  # rows per interleaved group (qweight.QROWS)


@dataclass
class ScaleFactors:
    d_super: torch.Tensor  # float32 [N, K / 256]
    d_sub: torch.Tensor  # int8 [N, K / group]
    m_super: torch.Tensor | None = None  # as d_*, kinds with a min only
    m_sub: torch.Tensor | None = None

    @staticmethod
    def verified(d: torch.Tensor, m: torch.Tensor | None, d_super: torch.Tensor, d_sub: torch.Tensor,
                 m_super: torch.Tensor | None, m_sub: torch.Tensor | None) -> ScaleFactors | None:
        """The factors if their products equal the flat scales bit for bit (NaN / inf from a lying
        file's scales included), else None: a factored weight must compute the flat one's values."""
        f = ScaleFactors(d_super.float().contiguous(), d_sub.to(torch.int8).contiguous(),
                         None if m_super is None else m_super.float().contiguous(),
                         None if m_sub is None else m_sub.to(torch.int8).contiguous())
        if (m is None) != (f.m_super is None) or not _same_bits(f.product(f.d_super, f.d_sub), d):
            return None
        if m is not None and not _same_bits(f.product(f.m_super, f.m_sub), m):  # type: ignore[arg-type]
            return None
        return f

    @staticmethod
    def product(sup: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        rep = sub.shape[1] // sup.shape[1]
        return sup.repeat_interleave(rep, dim=1) * sub.float()

    def narrow(self, dim: int, start: int, length: int, group: int) -> ScaleFactors | None:
        if dim == 0:
            return ScaleFactors(*(None if t is None else t[start : start + length] for t in self._all()))
        if start % SUPER or length % SUPER:
            return None  # the flat scales take it
        j0, nj, s0, ns = start // SUPER, length // SUPER, start // group, length // group
        sl = [slice(j0, j0 + nj), slice(s0, s0 + ns)] * 2
        return ScaleFactors(*(None if t is None else t[:, s] for t, s in zip(self._all(), sl, strict=True)))

    def pad_rows(self, extra: int) -> ScaleFactors:
        return ScaleFactors(*(None if t is None else torch.cat([t, t.new_zeros(extra, t.shape[1])])
                              for t in self._all()))

    def promote(self, rep: int, needs_min: bool) -> ScaleFactors:
        """The factors of a kind with `rep` scale groups per old one, and a min if `needs_min`."""
        d_sub = self.d_sub.repeat_interleave(rep, dim=1)
        m_super, m_sub = self.m_super, None if self.m_sub is None else self.m_sub.repeat_interleave(rep, dim=1)
        if needs_min and m_super is None:
            m_super, m_sub = torch.zeros_like(self.d_super), torch.zeros_like(d_sub)
        return ScaleFactors(self.d_super, d_sub, m_super, m_sub)

    @staticmethod
    def cat(parts: list[ScaleFactors | None]) -> ScaleFactors | None:
        if any(p is None for p in parts):
            return None
        cols = list(zip(*(p._all() for p in parts if p is not None), strict=True))
        return ScaleFactors(*(None if c[0] is None else torch.cat(list(c)) for c in cols))

    def records(self, which: str, groups: int) -> torch.Tensor:
        """The kernels' factored records of the scales ('d') or mins ('m'): uint8 [G, K / 256 * (32 + 64 S)],
        per group and super-block the 8 rows' float32 super-scales, then int8 subs (block, group, row)."""
        sup, sub = (self.d_super, self.d_sub) if which == "d" else (self.m_super, self.m_sub)
        assert sup is not None and sub is not None
        pad = groups * QROWS - sup.shape[0]
        if pad:
            sup = torch.cat([sup, sup.new_zeros(pad, sup.shape[1])])
            sub = torch.cat([sub, sub.new_zeros(pad, sub.shape[1])])
        nj = sup.shape[1]
        s8 = sub.shape[1] // nj  # 8 blocks x S scale groups per super-block
        a = sup.view(groups, QROWS, nj).permute(0, 2, 1).contiguous().view(torch.uint8)  # [G, nj, 32]
        b = sub.view(groups, QROWS, nj, s8).permute(0, 2, 3, 1).reshape(groups, nj, s8 * QROWS).view(torch.uint8)
        return torch.cat([a, b], dim=2).reshape(groups, -1).contiguous()

    @staticmethod
    def flat_from_records(rec: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
        """Row-major float32 scales [n, K / group] of factored records (the inverse of records + product)."""
        g, nj, s8 = rec.shape[0], k // SUPER, SUPER // group
        r = rec.view(g, nj, 4 * QROWS + s8 * QROWS)
        sup = r[:, :, : 4 * QROWS].contiguous().view(torch.float32)  # [G, nj, 8]
        sub = r[:, :, 4 * QROWS :].contiguous().view(torch.int8).view(g, nj, s8, QROWS)
        flat = sup[:, :, None, :] * sub.float()  # [G, nj, s8, 8]
        return flat.permute(0, 3, 1, 2).reshape(g * QROWS, nj * s8)[:n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._all() if t is not None)

    def _all(self) -> tuple[torch.Tensor | None, ...]:
        return self.d_super, self.d_sub, self.m_super, self.m_sub


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.float().contiguous().view(torch.int32))
