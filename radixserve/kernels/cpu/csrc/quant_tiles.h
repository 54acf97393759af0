// The register tiles of the quantised GEMM (quant_linear.cpp): one weight group of 8 output rows (ymm) or, on
// AVX512-VNNI, a pair of groups in one zmm, against R activation rows at a time: each kind's integer dot products
// and float steps. quant_linear.cpp drives them over rows, groups and threads; this file owns what one tile
// computes, and why its bits depend neither on R nor on which group shares its register. Layouts: quant_linear.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "quant_linear.h"

namespace radixserve {

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// f(std::integral_constant<int, layout>) for w's scale layout (kScalesFlat / kScalesFactored / kScalesHalf): every
// tile kernel takes the layout as a compile-time argument, so its scale loads inline.
template <typename F>
inline void with_scale_layout(const QMat& w, F&& f) {
  switch (w.scales) {
    case kScalesFlat: f(std::integral_constant<int, kScalesFlat>{}); break;
    case kScalesFactored: f(std::integral_constant<int, kScalesFactored>{}); break;
    default: f(std::integral_constant<int, kScalesHalf>{}); break;
  }
}

// Rows of activations are taken R at a time (R <= kTileRows): a block's weights are loaded (and, for
// Q4_1, unpacked) once and meet the R rows' broadcasts, so the weight work is shared by R dot
// products instead of being redone per row. Each row's own arithmetic is the same whatever R is
// (per-row accumulators, same order), so a row's result never depends on how many rows share the call.
// AVX512-VNNI (the avx512vnni variant): vpdpbusd multiplies 4 unsigned x signed byte pairs and adds
// them into an int32 lane in one instruction, replacing maddubs + madd (+ add) with identical sums.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RS_VNNI 1
#endif
// AVX-512VL gives 32 vector registers: 8 rows' accumulators and sums fit beside the unpacked weights,
// so each unpack serves twice the rows (a 512-row prefill's GEMMs ran ~20% faster on a Zen 4). AVX2's 16
// registers hold 4.
#ifdef RS_VNNI
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Software prefetch of the weight stream kPrefetch bytes ahead of the block being multiplied, at every row count
// (a decode step of a few rows is bound by how fast weights arrive; a long step's tiles barely notice the few
// prefetch instructions). The hardware prefetchers restart at every 4 KiB page and every new matrix (a MoE
// layer's experts are 8 short streams a token, a dense layer's MLP 2 long ones). A pair of groups (g, g + 1)
// is one contiguous stream advancing two blocks an iteration, so it is prefetched as one: ahead of the pair
// runs into the next pair, both of whose groups follow in memory (prefetching each group's own blocks left the
// next pair's second group cold). 8 KiB ahead ~ DRAM latency x one core's bandwidth with room: on a 2-vCPU Zen 4
// with ~31 GB/s, Gemma 3's 262,144 x 640 Q8_0 LM head at one row went from 7.2 ms (2 KiB, each group
// prefetched, pairs only at <= 2 rows) to 4.7-5.0 ms; 16 KiB measured 5.7-6.1 ms (docs/kernels_and_precision.md).
constexpr int64_t kPrefetch = 8192;
template <int64_t kBytes>
inline void prefetch_block(const void* p) {
  const char* c = static_cast<const char*>(p) + kPrefetch;
  for (int64_t o = 0; o < kBytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// The 4-bit kinds' and Q6's unpacking to 8-bit quarters, written once for 256-bit and (RS_VNNI) 512-bit registers:
// the ymm tiles, the zmm pair tiles and the AMX tiles' unpacking (quant_amx.h) run the same instructions on the
// same bytes, so their integer sums agree. The 16-bit shifts carry bits across a lane's two bytes only where the
// masks clear them.
inline __m256i v_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i v_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i v_sub8(__m256i a, __m256i b) { return _mm256_sub_epi8(a, b); }
inline __m256i v_srl16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
inline __m256i v_sll16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
#ifdef RS_VNNI
inline __m512i v_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i v_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i v_sub8(__m512i a, __m512i b) { return _mm512_sub_epi8(a, b); }
inline __m512i v_srl16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
inline __m512i v_sll16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
#endif

// Nibble quarter t of a Q4_1 / Q5 block (v: its 32 bytes; hb: a Q5 block's fifth-bit bytes) as the 8-bit
// layout's quarters 2t (low nibbles: elements 8t + c) and 2t + 1 (high: 8t + 4 + c), unsigned (Q5: 0..31).
// Q5 moves bits 2t (the low nibble's element) and 2t + 1 (the high's) of each fifth-bit byte to bit 4.
template <bool kQ5, typename V>
inline void nibble_quarters(V v, V hb, int t, V mask, V bit4, V& lo, V& hi) {
  lo = v_and(v, mask), hi = v_and(v_srl16(v, 4), mask);
  if (kQ5) {
    const V h = v_srl16(hb, 2 * t);
    lo = v_or(lo, v_and(v_sll16(h, 4), bit4));
    hi = v_or(hi, v_and(v_sll16(h, 3), bit4));
  }
}

// Q6 nibble quarter t (v: its 32 bytes; hp: the top-bit bytes of its scale group, t / 2) as the 8-bit layout's
// quarters 2t and 2t + 1, signed -32..31.
template <typename V>
inline void q6_quarters(V v, V hp, int t, V mask, V top, V off, V& lo, V& hi) {
  const V h = v_srl16(hp, 4 * (t & 1));
  lo = v_sub8(v_or(v_and(v, mask), v_and(v_sll16(h, 4), top)), off);
  hi = v_sub8(v_or(v_and(v_srl16(v, 4), mask), v_and(v_sll16(h, 2), top)), off);
}

// The 8 rows' scales (or mins) of scale group sg of block b in group g: one load (flat float32 or float16),
// or super * sub of the factored record (quant_linear.h). The empty asm makes the product an opaque value: -ffast-math
// may not fold it into the products that follow, so a factored weight computes the flat one's bits.
// Loading the super-scales once per 8 blocks instead (they change every 256 elements) measured slower:
// Q4_K at one row 0.170 -> 0.197 ms for 4096 x 2048 on a Zen 3, Q6_K 5% faster.
template <int S, int kF>
inline __m256 scales8(const void* base, int64_t nb, int64_t g, int64_t b, int sg) {
  const int64_t at = ((g * nb + b) * S + sg) * kQRows;
  if (kF == kScalesFlat) return _mm256_loadu_ps(static_cast<const float*>(base) + at);
  // the file's float16 scales as it stores them: widened exactly (F16C), the flat layout's float32 values
  if (kF == kScalesHalf) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                    static_cast<const uint16_t*>(base) + at)));
  const uint8_t* rec = static_cast<const uint8_t*>(base) + (g * (nb / 8) + b / 8) * factored_record_bytes(S);
  const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 4 * kQRows + ((b % 8) * S + sg) * kQRows));
  __m256 v = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(rec)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
  asm("" : "+x"(v));
  return v;
}

// A tile's R activation rows from row r0: their int8 values, block scales, and the sums a min term
// multiplies (`sums`: a.s, one per 32 elements, or a.s16, one per 16 (`per_block` 2); null for a kind without a min).
template <int R>
struct TileRows {
  const int8_t* q[R];
  const uint8_t* qu[R];  // q + 128 (RS_VNNI builds only; see Q8ActRows)
  const float* d[R];
  const float* s[R];
  TileRows(const Q8ActRows& a, int64_t r0, int64_t K, const std::vector<float>* sums, int per_block) {
    const int64_t nb = K / kQBlock;
    for (int r = 0; r < R; ++r) {
      q[r] = a.q.data() + (r0 + r) * K;
      qu[r] = a.qu.empty() ? nullptr : a.qu.data() + (r0 + r) * K;
      d[r] = a.d.data() + (r0 + r) * nb;
      s[r] = sums ? sums->data() + (r0 + r) * nb * per_block : nullptr;
    }
  }
};

// One quarter of 32 signed 8-bit weights (4 per row lane) against R rows' 4 activation bytes at xq[r] + off:
// s32[r] += each lane's 4 products. maddubs / dpbusd multiply unsigned x signed bytes, so the weights' |w|
// meets sign(w) * x: a weight of -128 (|w| = 128 unsigned) is right too, and a pair sum (2 * 128 * 127) fits
// int16, so each maddubs widens to int32 on its own. The 8-bit kinds and Q6 share it, so their sums agree.
template <int R>
inline void q8_quarter(__m256i wt, const int8_t* const* xq, int64_t off, __m256i* s32) {
  const __m256i aw = _mm256_abs_epi8(wt);
#ifndef RS_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int r = 0; r < R; ++r) {
    const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq[r] + off)), wt);
#ifdef RS_VNNI
    s32[r] = _mm256_dpbusd_epi32(s32[r], aw, sx);  // the same 4 products, one op
#else
    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
#endif
  }
}

// One scale group's float step, the one Q8_0 always had: acc[r] += sum * (d * xd).
template <int R>
inline void scale_group(__m256 d8, const __m256i* s32, const float* const* xd, int64_t b, __m256* acc) {
  for (int r = 0; r < R; ++r)
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(d8, _mm256_set1_ps(xd[r][b])), acc[r]);
}

// The 8-bit kinds (Q8_0, Q8_M, Q8_16, Q8_M16): S scale groups per 32-block (1 or 2), mins or not. The
// integer sums equal the plain products (q8_quarter); per scale group the float step (scale_group), then the
// min terms (acc += m * s).
template <int R, int S, bool kMin, int kF>
inline void tile_dot_q8(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m256* out8) {
  constexpr int kT = 8 / S;  // 4-element quarters per scale group
  const int64_t nb = w.K / kQBlock, K = w.K;
  const int8_t* wg = static_cast<const int8_t*>(w.data) + g * nb * 256;
  const TileRows<R> x(a, r0, K, kMin ? (S == 1 ? &a.s : &a.s16) : nullptr, S);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = wg + b * 256;
    prefetch_block<256>(wb);
    for (int sg = 0; sg < S; ++sg) {
      __m256i s32[R];
      for (int r = 0; r < R; ++r) s32[r] = _mm256_setzero_si256();
      for (int t = sg * kT; t < (sg + 1) * kT; ++t)
        q8_quarter<R>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32)), x.q, b * kQBlock + 4 * t, s32);
      scale_group<R>(scales8<S, kF>(w.d, nb, g, b, sg), s32, x.d, b, acc);
    }
    if (kMin) {
      for (int sg = 0; sg < S; ++sg) {
        const __m256 m8 = scales8<S, kF>(w.m, nb, g, b, sg);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x.s[r][b * S + sg]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out8[r] = acc[r];
}

// Q4_1 and Q5: nibbles unpacked once per load (Q5: each byte's fifth bit ORed in as bit 4), against
// the R rows. Both are unsigned values with a min, so the integer work is Q4_1's on 0..31 instead of
// 0..15 plus two shifts and masks per quarter: the 5-bit weights stream 160 + 64 bytes per 8 rows x 32
// instead of the 8-bit kinds' 256 + 64, for the same exact sums.
template <int R, bool kQ5, int kF>
inline void tile_dot_q4(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m256* out8) {
  constexpr int64_t kBytes = kQ5 ? 160 : 128;  // per 8-row block
  const int64_t nb = w.K / kQBlock, K = w.K;
#ifndef RS_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const TileRows<R> x(a, r0, K, &a.s, 1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  {
    const uint8_t* wg = static_cast<const uint8_t*>(w.data) + g * nb * kBytes;
    const __m256i mask = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = wg + b * kBytes;
      prefetch_block<kBytes>(wb);
      const __m256i hb = kQ5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128)) : _mm256_setzero_si256();
      __m256i p[R];
#ifndef RS_VNNI
      __m256i p32[R];  // Q5: int32 sums, widened every two quarters
      for (int r = 0; r < R; ++r) p32[r] = _mm256_setzero_si256();
#endif
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        __m256i lo, hi;
        nibble_quarters<kQ5>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32)), hb, t, mask, bit4,
                             lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = x.q[r] + b * kQBlock + 8 * t;
          // nibbles are unsigned: a pair sum is at most 2 * 15 * 127 = 3810, so the 8 of a block
          // (30480) still fit int16 and widen once per block
#ifdef RS_VNNI
          // int32 lanes directly: the same integer sums as maddubs + madd below, so the same bits
          p[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(p[r], lo, _mm256_set1_epi32(load_i32(xb))), hi,
                                     _mm256_set1_epi32(load_i32(xb + 4)));
#else
          p[r] = _mm256_add_epi16(p[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xb))),
                                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xb + 4)))));
#endif
        }
#ifndef RS_VNNI
        // Q5's values reach 31: a pair sum is at most 2 * 31 * 127 = 7874, so two quarters (31496) fit
        // int16 and four would not
        if (kQ5 && (t & 1)) {
          for (int r = 0; r < R; ++r) {
            p32[r] = _mm256_add_epi32(p32[r], _mm256_madd_epi16(p[r], ones));
            p[r] = _mm256_setzero_si256();
          }
        }
#endif
      }
      const __m256 d8 = scales8<1, kF>(w.d, nb, g, b, 0), m8 = scales8<1, kF>(w.m, nb, g, b, 0);
      for (int r = 0; r < R; ++r) {
#ifdef RS_VNNI
        const __m256 sum = _mm256_cvtepi32_ps(p[r]);
#else
        const __m256 sum = _mm256_cvtepi32_ps(kQ5 ? p32[r] : _mm256_madd_epi16(p[r], ones));
#endif
        acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d8, _mm256_set1_ps(x.d[r][b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x.s[r][b]), acc[r]);  // the Q4_1 min term
      }
    }
  }
  for (int r = 0; r < R; ++r) out8[r] = acc[r];
}

// Q6: each quarter's 32 bytes of nibbles and its top bits unpacked to two signed 8-bit quarters (values
// -32..31), then tile_dot_q8<R, 2, false>'s integer sums and float steps in its order (q8_quarter,
// scale_group): Q6_K's weights read 6.6 bits each (factored scales) instead of Q8_16's 10, for the same bits out.
template <int R, int kF>
inline void tile_dot_q6(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m256* out8) {
  const int64_t nb = w.K / kQBlock, K = w.K;
  const uint8_t* wg = static_cast<const uint8_t*>(w.data) + g * nb * 192;
  const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  const TileRows<R> x(a, r0, K, nullptr, 0);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wg + b * 192;
    prefetch_block<192>(wb);
    for (int sg = 0; sg < 2; ++sg) {  // 16 elements a scale group: nibble quarters 2 sg, 2 sg + 1
      const __m256i hp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * sg));
      __m256i s32[R];
      for (int r = 0; r < R; ++r) s32[r] = _mm256_setzero_si256();
      for (int t = 2 * sg; t < 2 * sg + 2; ++t) {
        __m256i lo, hi;  // the 8-bit layout's quarters 2t and 2t + 1: low nibbles, then high
        q6_quarters(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 32)), hp, t, mask, top, off, lo, hi);
        q8_quarter<R>(lo, x.q, b * kQBlock + 8 * t, s32);
        q8_quarter<R>(hi, x.q, b * kQBlock + 8 * t + 4, s32);
      }
      scale_group<R>(scales8<2, kF>(w.d, nb, g, b, sg), s32, x.d, b, acc);
    }
  }
  for (int r = 0; r < R; ++r) out8[r] = acc[r];
}

#ifdef RS_VNNI
// Two 8-row groups side by side in the 16 lanes of one zmm register (lanes 0-7 group g, 8-15 group g + 1).
// A 512-row prefill's GEMMs were bound by instruction issue, not by the dot products: per block of 8 rows x
// 32 x 8 activation rows the ymm kernel issues ~280 instructions for 64 vpdpbusd. Paired, each activation
// broadcast, dot-product instruction and float step serves 16 output rows, about half the instructions a
// product. Every lane computes the integer sums the ymm path computes and the same float steps in the same
// order, so a group's outputs are the same bits paired or alone (which groups pair depends on the thread split).
inline __m512i load_pair(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(b)), 1);
}

template <int S, int kF>
inline __m512 scales16(const void* base, int64_t nb, int64_t g, int64_t b, int sg) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(scales8<S, kF>(base, nb, g, b, sg)),
                            scales8<S, kF>(base, nb, g + 1, b, sg), 1);
}

// scale_group on 16 lanes
template <int R>
inline void scale_group2(__m512 d16, const __m512i* s32, const float* const* xd, int64_t b, __m512* acc) {
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_mul_ps(d16, _mm512_set1_ps(xd[r][b])), acc[r]);
}

// The mins' term of block b on 16 lanes (kinds with mins): acc[r] += each scale group's mins x row r's activation
// sum over that group (xs[r][b * S + sg])
template <int R, int S, int kF>
inline void min_group2(const QMat& w, int64_t nb, int64_t g, int64_t b, const float* const* xs, __m512* acc) {
  for (int sg = 0; sg < S; ++sg) {
    const __m512 m16 = scales16<S, kF>(w.m, nb, g, b, sg);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xs[r][b * S + sg]), acc[r]);
  }
}

// Signed weight quarters wq[0 .. kT) (8-bit kinds, Q6) against the R rows: vpdpbusd multiplies unsigned x
// signed, and the ymm path's sign trick (|w| x sign(w) x) costs an instruction per row and quarter. Here the
// activations are the unsigned side, as q + 128 (Q8ActRows::qu), and each row's sum starts at -128 sum(w),
// which is shared by the rows: sum (q + 128) w - 128 sum w = sum q w, the same int32 (|sum| < 2^21).
template <int R, int kT>
inline void signed_quarters2(const __m512i* wq, const uint8_t* const* xu, int64_t off, __m512i* s32) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i ws = _mm512_setzero_si512();
  for (int t = 0; t < kT; ++t) ws = _mm512_dpbusd_epi32(ws, ones, wq[t]);
  const __m512i s0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(ws, 7));
  for (int r = 0; r < R; ++r) s32[r] = s0;
  for (int t = 0; t < kT; ++t)
    for (int r = 0; r < R; ++r)
      s32[r] = _mm512_dpbusd_epi32(s32[r], _mm512_set1_epi32(load_i32(xu[r] + off + 4 * t)), wq[t]);
}

// tile_dot_q8 on a pair of groups
template <int R, int S, bool kMin, int kF>
inline void tile2_dot_q8(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m512* out16) {
  constexpr int kT = 8 / S;
  const int64_t nb = w.K / kQBlock, K = w.K;
  const int8_t* wg0 = static_cast<const int8_t*>(w.data) + g * nb * 256;
  const int8_t* wg1 = wg0 + nb * 256;
  const TileRows<R> x(a, r0, K, kMin ? (S == 1 ? &a.s : &a.s16) : nullptr, S);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t *wb0 = wg0 + b * 256, *wb1 = wg1 + b * 256;
    prefetch_block<2 * 256>(wg0 + 2 * b * 256);  // the pair as one stream
    for (int sg = 0; sg < S; ++sg) {
      __m512i wq[kT], s32[R];
      for (int t = 0; t < kT; ++t) wq[t] = load_pair(wb0 + (sg * kT + t) * 32, wb1 + (sg * kT + t) * 32);
      signed_quarters2<R, kT>(wq, x.qu, b * kQBlock + 4 * sg * kT, s32);
      scale_group2<R>(scales16<S, kF>(w.d, nb, g, b, sg), s32, x.d, b, acc);
    }
    if (kMin) min_group2<R, S, kF>(w, nb, g, b, x.s, acc);
  }
  for (int r = 0; r < R; ++r) out16[r] = acc[r];
}

// tile_dot_q4 on a pair of groups
template <int R, bool kQ5, int kF>
inline void tile2_dot_q4(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m512* out16) {
  constexpr int64_t kBytes = kQ5 ? 160 : 128;
  const int64_t nb = w.K / kQBlock, K = w.K;
  const TileRows<R> x(a, r0, K, &a.s, 1);
  const uint8_t* wg0 = static_cast<const uint8_t*>(w.data) + g * nb * kBytes;
  const uint8_t* wg1 = wg0 + nb * kBytes;
  const __m512i mask = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *wb0 = wg0 + b * kBytes, *wb1 = wg1 + b * kBytes;
    prefetch_block<2 * kBytes>(wg0 + 2 * b * kBytes);  // the pair as one stream
    const __m512i hb = kQ5 ? load_pair(wb0 + 128, wb1 + 128) : _mm512_setzero_si512();
    __m512i p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      __m512i lo, hi;
      nibble_quarters<kQ5>(load_pair(wb0 + t * 32, wb1 + t * 32), hb, t, mask, bit4, lo, hi);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = x.q[r] + b * kQBlock + 8 * t;
        p[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(p[r], lo, _mm512_set1_epi32(load_i32(xb))), hi,
                                   _mm512_set1_epi32(load_i32(xb + 4)));
      }
    }
    const __m512 d16 = scales16<1, kF>(w.d, nb, g, b, 0), m16 = scales16<1, kF>(w.m, nb, g, b, 0);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[r]), _mm512_mul_ps(d16, _mm512_set1_ps(x.d[r][b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(x.s[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out16[r] = acc[r];
}

// tile_dot_q6 on a pair of groups: the same unpacking to signed quarters, then signed_quarters2
template <int R, int kF>
inline void tile2_dot_q6(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m512* out16) {
  const int64_t nb = w.K / kQBlock, K = w.K;
  const uint8_t* wg0 = static_cast<const uint8_t*>(w.data) + g * nb * 192;
  const uint8_t* wg1 = wg0 + nb * 192;
  const __m512i mask = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  const TileRows<R> x(a, r0, K, nullptr, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *wb0 = wg0 + b * 192, *wb1 = wg1 + b * 192;
    prefetch_block<2 * 192>(wg0 + 2 * b * 192);  // the pair as one stream
    for (int sg = 0; sg < 2; ++sg) {
      const __m512i hp = load_pair(wb0 + 128 + 32 * sg, wb1 + 128 + 32 * sg);
      __m512i wq[4], s32[R];
      for (int u = 0; u < 2; ++u) {  // nibble quarter t = 2 sg + u: the 8-bit layout's quarters 2t, 2t + 1
        const int t = 2 * sg + u;
        q6_quarters(load_pair(wb0 + t * 32, wb1 + t * 32), hp, t, mask, top, off, wq[2 * u], wq[2 * u + 1]);
      }
      signed_quarters2<R, 4>(wq, x.qu, b * kQBlock + 16 * sg, s32);
      scale_group2<R>(scales16<2, kF>(w.d, nb, g, b, sg), s32, x.d, b, acc);
    }
  }
  for (int r = 0; r < R; ++r) out16[r] = acc[r];
}

template <int R, int kF>
inline void tile2_dot_kind(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m512* out16) {
  switch (w.kind) {
    case QKind::Q8_0: tile2_dot_q8<R, 1, false, kF>(w, g, a, r0, out16); break;
    case QKind::Q4_1: tile2_dot_q4<R, false, kF>(w, g, a, r0, out16); break;
    case QKind::Q8_M: tile2_dot_q8<R, 1, true, kF>(w, g, a, r0, out16); break;
    case QKind::Q8_16: tile2_dot_q8<R, 2, false, kF>(w, g, a, r0, out16); break;
    case QKind::Q8_M16: tile2_dot_q8<R, 2, true, kF>(w, g, a, r0, out16); break;
    case QKind::Q5: tile2_dot_q4<R, true, kF>(w, g, a, r0, out16); break;
    case QKind::Q6: tile2_dot_q6<R, kF>(w, g, a, r0, out16); break;
  }
}

// R rows from r0 of a pair of groups g, g + 1 (16 outputs a row in acc; g + 1 may be the last, partial group)
// into out, plus the bias: the register tiles' and the AMX tiles' (quant_amx.h) one store.
template <int R>
inline void store_pair_rows(const QMat& w, int64_t g, const __m512* acc, int64_t r0, const float* bias, float* out,
                            int64_t ldo) {
  const int64_t n0 = g * kQRows, rows = std::min(2 * kQRows, w.N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 v = bias != nullptr ? _mm512_add_ps(acc[r], bv) : acc[r];
    _mm512_mask_storeu_ps(out + (r0 + r) * ldo + n0, keep, v);
  }
}

// Groups g and g + 1 (g + 1 may be the last, partial group) for R activation rows from r0.
template <int R>
inline void tile2_store(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, const float* bias, float* out,
                        int64_t ldo) {
  __m512 acc[R];
  with_scale_layout(w, [&](auto kf) { tile2_dot_kind<R, decltype(kf)::value>(w, g, a, r0, acc); });
  store_pair_rows<R>(w, g, acc, r0, bias, out, ldo);
}
#endif

template <int R, int kF>
inline void tile_dot_kind(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m256* out8) {
  switch (w.kind) {
    case QKind::Q8_0: tile_dot_q8<R, 1, false, kF>(w, g, a, r0, out8); break;
    case QKind::Q4_1: tile_dot_q4<R, false, kF>(w, g, a, r0, out8); break;
    case QKind::Q8_M: tile_dot_q8<R, 1, true, kF>(w, g, a, r0, out8); break;
    case QKind::Q8_16: tile_dot_q8<R, 2, false, kF>(w, g, a, r0, out8); break;
    case QKind::Q8_M16: tile_dot_q8<R, 2, true, kF>(w, g, a, r0, out8); break;
    case QKind::Q5: tile_dot_q4<R, true, kF>(w, g, a, r0, out8); break;
    case QKind::Q6: tile_dot_q6<R, kF>(w, g, a, r0, out8); break;
  }
}

template <int R>
inline void tile_dot(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, __m256* out8) {
  with_scale_layout(w, [&](auto kf) { tile_dot_kind<R, decltype(kf)::value>(w, g, a, r0, out8); });
}

template <int R>
inline void tile_store(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r0, const float* bias, float* out,
                       int64_t ldo) {
  __m256 acc[R];
  tile_dot<R>(w, g, a, r0, acc);
  const int64_t n0 = g * kQRows, rows = std::min(kQRows, w.N - n0);
  for (int r = 0; r < R; ++r) {
    float* o = out + (r0 + r) * ldo + n0;
    __m256 v = acc[r];
    if (rows == kQRows) {
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0));
      _mm256_storeu_ps(o, v);
    } else {
      alignas(32) float tmp[kQRows];
      _mm256_store_ps(tmp, v);
      for (int64_t i = 0; i < rows; ++i) o[i] = tmp[i] + (bias != nullptr ? bias[n0 + i] : 0.f);
    }
  }
}
#endif

}  // namespace radixserve
