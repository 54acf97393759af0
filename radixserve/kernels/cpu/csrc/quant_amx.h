// AMX-INT8 tiles for the quantised GEMM's long steps (the `amx` variant: quant_linear.cpp calls them for 16 rows
// of activations at a time, the VNNI register tiles of quant_tiles.h take the rest and every short step).
//
// Why the bits equal the VNNI path's: a scale group's integer sum sum_k q_x[k] * q_w[k] is exact in int32 either
// way (TDPBSSD adds the same products), and the float steps after it (acc += sum * (d_w * d_x), then the min
// terms) are quant_tiles.h's own, lane by lane, in the same order, on the same scales (scales16). So a row's
// result does not depend on whether its step ran 1, 15 or 512 rows: one precision whatever the batch, which is
// what lets the default mode stay batch-invariant on AMX (before, long steps there ran bf16 GEMMs).
//
// The weights are unpacked once per pair of 8-row groups (16 outputs, one tile's width) into signed bytes in
// the tile's layout: row (block b, quarter t) holds 64 bytes, output n's four elements 4t .. 4t + 3 at 4n. Then
// each 16-row activation tile and scale group (32 or 16 elements) is one TDPBSSD into an int32 16 x 16 tile,
// four in flight (tmm0-3), stored and folded into 16 zmm accumulators by the float steps.
#pragma once

#include "quant_tiles.h"

#if defined(RS_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RS_AMX 1
#endif

#ifdef RS_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace radixserve {

constexpr int64_t kAmxRows = 16;  // activation rows per tile

// Linux hands a process AMX's tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once
// per process. A kernel that refuses (or predates AMX support) leaves the VNNI tiles in charge.
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: int32 sums 16 x 16; tmm4-5: activations 16 rows x kc bytes; tmm6-7: weights kc / 4 rows x 64 bytes.
// Loaded per call: the tile configuration is per thread and oneDNN's bf16 kernels load their own.
inline void amx_configure(int kc) {
  AmxConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(kc);
  for (int t = 6; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(kc / 4), c.colsb[t] = 64;
  // GCC 12 does not see ldtilecfg read the whole 64 bytes: out of line, this function kept only the palette
  // byte's store and dropped the rows and columns, so the first tile op raised SIGILL. The barrier makes every
  // store to c land before the load.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Group g's block b as the 8-bit layout's 8 signed quarters (row i's bytes 4i .. 4i + 3 = elements 4t .. 4t + 3):
// every kind's values as its register tiles unpack them (Q4_1 / Q5 0..31, Q6 -32..31), so the sums are theirs.
inline void unpack_quarters(const QMat& w, int64_t g, int64_t b, __m256i* q) {
  const int64_t nb = w.K / kQBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  switch (w.kind) {
    case QKind::Q4_1:
    case QKind::Q5: {
      const bool q5 = w.kind == QKind::Q5;
      const int64_t bytes = q5 ? 160 : 128;
      const uint8_t* wb = static_cast<const uint8_t*>(w.data) + (g * nb + b) * bytes;
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      const __m256i hb = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128)) : _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32));
        if (q5) {
          nibble_quarters<true>(v, hb, t, mask, bit4, q[2 * t], q[2 * t + 1]);
        } else {
          nibble_quarters<false>(v, hb, t, mask, bit4, q[2 * t], q[2 * t + 1]);
        }
      }
      return;
    }
    case QKind::Q6: {
      const uint8_t* wb = static_cast<const uint8_t*>(w.data) + (g * nb + b) * 192;
      const __m256i top = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
      for (int t = 0; t < 4; ++t) {
        q6_quarters(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * (t / 2))), t, mask, top, off,
                    q[2 * t], q[2 * t + 1]);
      }
      return;
    }
    default: {  // the 8-bit kinds: already quarters
      const int8_t* wb = static_cast<const int8_t*>(w.data) + (g * nb + b) * 256;
      for (int t = 0; t < 8; ++t) q[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32));
    }
  }
}

// Groups g, g + 1 into `tiles` [nb * 8 rows of 64 bytes]: the weight side of every TDPBSSD for the pair.
inline void unpack_pair(const QMat& w, int64_t g, std::vector<int8_t>& tiles) {
  const int64_t nb = w.K / kQBlock;
  tiles.resize(static_cast<size_t>(nb * 8 * 64));
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q0[8], q1[8];
    unpack_quarters(w, g, b, q0);
    unpack_quarters(w, g + 1, b, q1);
    int8_t* dst = tiles.data() + b * 8 * 64;
    for (int t = 0; t < 8; ++t) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 64), q0[t]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 64 + 32), q1[t]);
    }
  }
}

// One scale group's product into tmm C (activation tile A, weight tile B), stored to `sums` [16 x 16]. A macro:
// GCC's tile intrinsics spell the register number into the instruction's text, so it must be a literal.
#define RS_AMX_UNIT(C, A, B, x, ldx, wt, sums) \
  do {                                        \
    _tile_zero(C);                            \
    _tile_loadd(A, x, ldx);                   \
    _tile_loadd(B, wt, 64);                   \
    _tile_dpbssd(C, A, B);                    \
    _tile_stored(C, sums, 64);                \
  } while (0)

// 16 activation rows from r0 against the unpacked pair (g, g + 1): out16[r] as tile2_dot_kind's, bit for bit.
template <int S, bool kMin, int kF>
inline void amx_pair_rows(const QMat& w, int64_t g, const std::vector<int8_t>& tiles, const Q8ActRows& a,
                          int64_t r0, __m512* acc) {
  constexpr int kc = kQBlock / S;        // elements per scale group
  constexpr int kUnits = 4;              // scale groups in flight (tmm0-3)
  constexpr int kBlocks = kUnits / S;    // blocks per batch
  const int64_t nb = w.K / kQBlock, K = w.K;
  const int8_t* x = a.q.data() + r0 * K;
  const TileRows<kAmxRows> rows(a, r0, K, kMin ? (S == 1 ? &a.s : &a.s16) : nullptr, S);  // scales and sums
  // Two buffers: a batch's sums are folded while the next batch's products run, so the float steps never wait
  // on the tile stores just issued (folded right after them, the step ran at the VNNI path's speed)
  alignas(64) int32_t sums[2][kUnits][kAmxRows * 16];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  // unit u of a batch from block b0: block b0 + u / S, scale group u % S: activations from element (b0 * S + u) * kc,
  // weight rows from quarter (b0 * S + u) * kc / 4
  auto issue = [&](int64_t b0, int32_t (*dst)[kAmxRows * 16]) {
    const int units = static_cast<int>(std::min<int64_t>(kBlocks, nb - b0)) * S;
    auto xa = [&](int u) { return x + (b0 * S + u) * kc; };
    auto wa = [&](int u) { return tiles.data() + ((b0 * S + u) * kc / 4) * 64; };
    RS_AMX_UNIT(0, 4, 6, xa(0), K, wa(0), dst[0]);
    if (units > 1) RS_AMX_UNIT(1, 5, 7, xa(1), K, wa(1), dst[1]);
    if (units > 2) RS_AMX_UNIT(2, 4, 6, xa(2), K, wa(2), dst[2]);
    if (units > 3) RS_AMX_UNIT(3, 5, 7, xa(3), K, wa(3), dst[3]);
  };
  issue(0, sums[0]);
  for (int64_t b0 = 0, i = 0; b0 < nb; b0 += kBlocks, ++i) {
    if (b0 + kBlocks < nb) issue(b0 + kBlocks, sums[(i + 1) & 1]);
    const int nblk = static_cast<int>(std::min<int64_t>(kBlocks, nb - b0));
    for (int j = 0; j < nblk; ++j) {
      const int64_t b = b0 + j;
      for (int sg = 0; sg < S; ++sg) {  // the register tiles' float steps, in their order
        const int32_t* s = sums[i & 1][j * S + sg];
        __m512i s32[kAmxRows];
        for (int r = 0; r < kAmxRows; ++r) s32[r] = _mm512_load_si512(s + 16 * r);
        scale_group2<kAmxRows>(scales16<S, kF>(w.d, nb, g, b, sg), s32, rows.d, b, acc);
      }
      if (kMin) min_group2<kAmxRows, S, kF>(w, nb, g, b, rows.s, acc);
    }
  }
}

template <int kF>
inline void amx_pair_kind(const QMat& w, int64_t g, const std::vector<int8_t>& tiles, const Q8ActRows& a, int64_t r0,
                          __m512* acc) {
  switch (w.kind) {
    case QKind::Q8_0: amx_pair_rows<1, false, kF>(w, g, tiles, a, r0, acc); break;
    case QKind::Q4_1:
    case QKind::Q5:
    case QKind::Q8_M: amx_pair_rows<1, true, kF>(w, g, tiles, a, r0, acc); break;
    case QKind::Q8_16:
    case QKind::Q6: amx_pair_rows<2, false, kF>(w, g, tiles, a, r0, acc); break;
    case QKind::Q8_M16: amx_pair_rows<2, true, kF>(w, g, tiles, a, r0, acc); break;
  }
}

// Rows r0 .. r0 + 16 of groups g, g + 1 (g + 1 may be the last, partial group), stored as tile2_store does.
inline void amx_pair_store(const QMat& w, int64_t g, const std::vector<int8_t>& tiles, const Q8ActRows& a, int64_t r0,
                           const float* bias, float* out, int64_t ldo) {
  __m512 acc[kAmxRows];
  with_scale_layout(w, [&](auto kf) { amx_pair_kind<decltype(kf)::value>(w, g, tiles, a, r0, acc); });
  store_pair_rows<kAmxRows>(w, g, acc, r0, bias, out, ldo);
}

}  // namespace radixserve
#endif
