// Weight-only low-bit linear layers for the few rows of a decode step: weights of the seven kinds in 8-row
// interleaved groups (layout in quant_linear.h) against block-quantised int8 activations. Op schema:
// ops.cpp; built per CPU ISA by radixserve/kernels/cpu/loader.py.
//
// A decode step at one row is bound by the weight bytes it streams (Q8_0 is ~27% of float32, Q4_1
// ~16%) and, on a small CPU, by the integer work per weight. AVX2's maddubs multiplies 32 (unsigned,
// signed) byte pairs into 16-bit sums and madd widens them to int32. In the interleaved layout each
// 32-byte weight load meets one broadcast of 4 activation bytes, the 8 rows of a group accumulate in
// the 8 lanes of one register, and the per-block scales of the 8 rows are one vector: no scalar
// scale products and no horizontal sums (the row-major kernel spent as long on those as on the
// products). Measured on the 2-core AVX2 dev machine, one row of 3072 x 576 Q4_1: see the README.
#include "ops.h"
#include "quant_amx.h"
#include "quant_linear.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace radixserve {

namespace {

#if !(defined(__AVX2__) && defined(__FMA__))
// Row i's scale (or min) of scale group sg of block b in group g, flat or factored (as scales8).
inline float scale_at(const QMat& w, const void* base, int64_t nb, int64_t S, int64_t g, int64_t b, int64_t sg,
                      int i) {
  const int64_t at = ((g * nb + b) * S + sg) * kQRows + i;
  if (w.scales == kScalesFlat) return static_cast<const float*>(base)[at];
  if (w.scales == kScalesHalf) return static_cast<float>(static_cast<const c10::Half*>(base)[at]);
  const uint8_t* rec = static_cast<const uint8_t*>(base) + (g * (nb / 8) + b / 8) * factored_record_bytes(S);
  float sup;
  std::memcpy(&sup, rec + 4 * i, sizeof(sup));
  volatile float v = sup * static_cast<float>(static_cast<int8_t>(rec[4 * kQRows + ((b % 8) * S + sg) * kQRows + i]));
  return v;  // volatile: rounded here, as the vector path's opaque product
}

// Portable loops (the `generic` variant): one row at a time, the same integer products and the same
// per-block float accumulation as the vector path.
void row_dot_generic(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r, float* out8) {
  const QKindInfo& info = *qkind_info(static_cast<int64_t>(w.kind));
  const int64_t nb = w.K / kQBlock, S = info.scales_per_block;
  const int8_t* xq = a.q.data() + r * w.K;
  const float* xs = (S == 1 ? a.s.data() : a.s16.data()) + r * nb * S;
  float acc[kQRows] = {0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const float xd = a.d[r * nb + b];
    if (info.bits == 6) {
      const uint8_t* wb = static_cast<const uint8_t*>(w.data) + (g * nb + b) * 192;
      for (int64_t sg = 0; sg < 2; ++sg) {
        int32_t s[kQRows] = {0};
        for (int t = 2 * sg; t < 2 * sg + 2; ++t)
          for (int i = 0; i < kQRows; ++i)
            for (int c = 0; c < 4; ++c) {
              const int32_t byte = wb[t * 32 + i * 4 + c], h = wb[128 + 32 * sg + i * 4 + c] >> (4 * (t & 1));
              s[i] += (((byte & 0x0F) | ((h & 3) << 4)) - 32) * int32_t(xq[b * kQBlock + 8 * t + c]) +
                      (((byte >> 4) | (((h >> 2) & 3) << 4)) - 32) * int32_t(xq[b * kQBlock + 8 * t + 4 + c]);
            }
        for (int i = 0; i < kQRows; ++i) acc[i] += static_cast<float>(s[i]) * (scale_at(w, w.d, nb, S, g, b, sg, i) * xd);
      }
    } else if (info.bits == 8) {
      const int8_t* wb = static_cast<const int8_t*>(w.data) + (g * nb + b) * 256;
      for (int64_t sg = 0; sg < S; ++sg) {
        int32_t s[kQRows] = {0};
        for (int64_t t = sg * 8 / S; t < (sg + 1) * 8 / S; ++t)
          for (int i = 0; i < kQRows; ++i)
            for (int c = 0; c < 4; ++c) s[i] += int32_t(wb[t * 32 + i * 4 + c]) * int32_t(xq[b * kQBlock + 4 * t + c]);
        for (int i = 0; i < kQRows; ++i) acc[i] += static_cast<float>(s[i]) * (scale_at(w, w.d, nb, S, g, b, sg, i) * xd);
      }
    } else {
      int32_t s[kQRows] = {0};
      const uint8_t* wb = static_cast<const uint8_t*>(w.data) + (g * nb + b) * info.block_bytes();
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < kQRows; ++i)
          for (int c = 0; c < 4; ++c) {
            const uint8_t byte = wb[t * 32 + i * 4 + c];
            const int32_t h = info.bits == 5 ? wb[128 + i * 4 + c] >> (2 * t) : 0;  // Q5's fifth bits
            s[i] += (int32_t(byte & 0x0F) | ((h & 1) << 4)) * int32_t(xq[b * kQBlock + 8 * t + c]) +
                    (int32_t(byte >> 4) | ((h & 2) << 3)) * int32_t(xq[b * kQBlock + 8 * t + 4 + c]);
          }
      for (int i = 0; i < kQRows; ++i) acc[i] += static_cast<float>(s[i]) * (scale_at(w, w.d, nb, 1, g, b, 0, i) * xd);
    }
    if (info.has_min)
      for (int64_t sg = 0; sg < S; ++sg)
        for (int i = 0; i < kQRows; ++i) acc[i] += scale_at(w, w.m, nb, S, g, b, sg, i) * xs[b * S + sg];
  }
  for (int i = 0; i < kQRows; ++i) out8[i] = acc[i];
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
template <bool kPair, int R>
inline void store_tile(const QMat& w, int64_t g, const Q8ActRows& a, int64_t r, const float* bias, float* out,
                       int64_t ldo) {
#ifdef RS_VNNI
  if constexpr (kPair) {
    tile2_store<R>(w, g, a, r, bias, out, ldo);
    return;
  }
#endif
  tile_store<R>(w, g, a, r, bias, out, ldo);
}

// Rows r0 .. r1 of group g (kPair: groups g, g + 1), in tiles of kTileRows rows and one tile of the rest.
template <bool kPair>
void group_rows(const QMat& w, int64_t g, const Q8ActRows& a, const float* bias, float* out, int64_t ldo,
                int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) store_tile<kPair, kTileRows>(w, g, a, r, bias, out, ldo);
  switch (r1 - r) {
#ifdef RS_VNNI
    case 7: store_tile<kPair, 7>(w, g, a, r, bias, out, ldo); break;
    case 6: store_tile<kPair, 6>(w, g, a, r, bias, out, ldo); break;
    case 5: store_tile<kPair, 5>(w, g, a, r, bias, out, ldo); break;
    case 4: store_tile<kPair, 4>(w, g, a, r, bias, out, ldo); break;
#endif
    case 3: store_tile<kPair, 3>(w, g, a, r, bias, out, ldo); break;
    case 2: store_tile<kPair, 2>(w, g, a, r, bias, out, ldo); break;
    case 1: store_tile<kPair, 1>(w, g, a, r, bias, out, ldo); break;
    default: break;
  }
}
#endif

// Rows r0 .. r1 of the output for weight groups g0 .. g1.
void qgemm_block(const QMat& w, const Q8ActRows& a, const float* bias, float* out, int64_t ldo, int64_t g0,
                 int64_t g1, int64_t r0, int64_t r1) {
#ifdef RS_AMX
  // 16 rows or more: pairs of groups on AMX tiles (quant_amx.h: the same bits), the rows past the last full tile
  // and a lone group on the register tiles
  const bool amx = r1 - r0 >= kAmxRows && g1 - g0 >= 2 && amx_usable();
  thread_local std::vector<int8_t> tiles;
  if (amx) amx_configure(static_cast<int>(kQBlock / qkind_info(static_cast<int64_t>(w.kind))->scales_per_block));
#endif
  for (int64_t g = g0; g < g1; ++g) {
#if defined(__AVX2__) && defined(__FMA__)
#ifdef RS_VNNI
    if (g + 1 < g1) {
#ifdef RS_AMX
      if (amx) {
        unpack_pair(w, g, tiles);
        int64_t r = r0;
        for (; r + kAmxRows <= r1; r += kAmxRows) amx_pair_store(w, g, tiles, a, r, bias, out, ldo);
        group_rows<true>(w, g, a, bias, out, ldo, r, r1);
        ++g;
        continue;
      }
#endif
      group_rows<true>(w, g, a, bias, out, ldo, r0, r1);
      ++g;
      continue;
    }
#endif
    group_rows<false>(w, g, a, bias, out, ldo, r0, r1);
#else
    const int64_t n0 = g * kQRows, rows = std::min(kQRows, w.N - n0);
    float tmp[kQRows];
    for (int64_t r = r0; r < r1; ++r) {
      row_dot_generic(w, g, a, r, tmp);
      float* o = out + r * ldo + n0;
      for (int64_t i = 0; i < rows; ++i) o[i] = tmp[i] + (bias != nullptr ? bias[n0 + i] : 0.f);
    }
#endif
  }
#ifdef RS_AMX
  if (amx) _tile_release();  // a thread holding tile state makes every context switch save 8 KiB more
#endif
}

}  // namespace

const QKindInfo* qkind_info(int64_t kind) {
  static const QKindInfo kInfo[kNumQKinds] = {
      {"Q8_0", 1, false, 8}, {"Q4_1", 1, true, 4}, {"Q8_M", 1, true, 8},
      {"Q8_16", 2, false, 8}, {"Q8_M16", 2, true, 8}, {"Q5", 1, true, 5}, {"Q6", 2, false, 6},
  };
  return kind >= 0 && kind < kNumQKinds ? &kInfo[kind] : nullptr;
}

QMat qmat_from_tensors(int64_t kind, int64_t N, int64_t K, const at::Tensor& data, const at::Tensor& d,
                       const at::Tensor& m, const char* what, int64_t experts) {
  QMat w;
  const QKindInfo* info = qkind_info(kind);
  TORCH_CHECK(info != nullptr, what, ": unknown weight kind ", kind,
              " (0 = Q8_0, 1 = Q4_1, 2 = Q8_M, 3 = Q8_16, 4 = Q8_M16, 5 = Q5, 6 = Q6)");
  TORCH_CHECK(N > 0 && K > 0 && K % kQBlock == 0, what, ": K (", K, ") must be a positive multiple of 32");
  w.kind = static_cast<QKind>(kind);
  w.N = N, w.K = K, w.G = (N + kQRows - 1) / kQRows;
  const int64_t nb = K / kQBlock;
  const int64_t per_block = info->block_bytes();
  const bool packed = info->bits < 8;
  const int64_t E = experts;
  TORCH_CHECK(data.is_contiguous() && data.numel() == E * w.G * nb * per_block &&
                  data.scalar_type() == (packed ? at::kByte : at::kChar),
              what, ": ", info->name, " data must be ", packed ? "uint8" : "int8", " with ",
              E * w.G * nb * per_block, " elements (8-row groups of ", N, " x ", K, E > 1 ? ", per expert" : "", ")");
  const int64_t S = info->scales_per_block;
  w.scales = d.scalar_type() == at::kByte ? kScalesFactored : d.scalar_type() == at::kHalf ? kScalesHalf : kScalesFlat;
  if (w.scales == kScalesFactored) {
    TORCH_CHECK(nb % 8 == 0, what, ": factored scales need K (", K, ") a multiple of 256");
    TORCH_CHECK(d.is_contiguous() && d.numel() == E * w.G * (nb / 8) * factored_record_bytes(S), what, ": ", info->name,
                " factored scales must be uint8 [groups, super-blocks * ", factored_record_bytes(S), "]");
  } else {
    TORCH_CHECK(d.is_contiguous() && (d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf) &&
                    d.numel() == E * w.G * nb * S * kQRows, what, ": ", info->name,
                " scales must be float32 or float16 [groups, blocks * ", S * kQRows, "] or factored uint8");
  }
  if (info->has_min) {
    TORCH_CHECK(m.is_contiguous() && m.scalar_type() == d.scalar_type() && m.numel() == d.numel(), what, ": ",
                info->name, " mins must be laid out like the scales");
    w.m = m.data_ptr();
  }
  w.data = data.data_ptr();
  w.d = d.data_ptr();
  return w;
}

// One 32-block of activations: q = round(x * (127 / amax)) to int8, the two 16-halves' sums of q, and the scale
// d = amax / 127 (returned). Written so: -ffast-math turned 1 / (amax / 127) into this anyway, and spelt out it is
// one definition the tests' reference can follow (x / d rounds some ties the other way). The AVX2 path computes
// the scalar one's values: the same max, the same single multiply, and cvtps rounds to nearest even as nearbyint
// does in the default rounding mode; it took a decode step's 120 quantisations from ~0.28 to ~0.05 ms.
inline float quantize_block(const float* src, int8_t* dst, int32_t* half) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i);
  __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));
  for (int h = 0; h < 2; ++h) {  // elements 16h .. 16h + 15
    const __m256i s8 = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    half[h] = _mm_cvtsi128_si32(s4);
  }
  // packs work within 128-bit lanes: the dwords come out as elements 0-3, 8-11, 16-19, 24-27, 4-7, ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
#else
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
  const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  half[0] = half[1] = 0;
  for (int64_t j = 0; j < kQBlock; ++j) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(src[j] * inv));
    dst[j] = static_cast<int8_t>(q);
    half[j / 16] += q;
  }
  return d;
#endif
}

void quantize_rows_q8(const float* x, int64_t M, int64_t K, int64_t ldx, Q8ActRows& a) {
  const int64_t nb = K / kQBlock;
  a.M = M, a.K = K;
  a.q.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * nb));
  a.s.resize(static_cast<size_t>(M * nb));
  a.s16.resize(static_cast<size_t>(M * nb * 2));
#ifdef RS_VNNI
  a.qu.resize(static_cast<size_t>(M * K));
#endif
  // Rows are independent: a prefill's hundreds of rows split across the threads (a decode step's few
  // rows stay on one; the grain keeps each task at least ~16k elements).
  parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t ra, int64_t rb) {
    for (int64_t r = ra; r < rb; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* dst = a.q.data() + r * K + b * kQBlock;
        int32_t half[2] = {0, 0};
        const float d = quantize_block(x + r * ldx + b * kQBlock, dst, half);
#ifdef RS_VNNI
        uint8_t* du = a.qu.data() + r * K + b * kQBlock;
        for (int64_t j = 0; j < kQBlock; ++j) du[j] = static_cast<uint8_t>(dst[j] ^ 0x80);  // q + 128
#endif
        a.d[r * nb + b] = d;
        a.s[r * nb + b] = d * static_cast<float>(half[0] + half[1]);
        a.s16[(r * nb + b) * 2] = d * static_cast<float>(half[0]);
        a.s16[(r * nb + b) * 2 + 1] = d * static_cast<float>(half[1]);
      }
    }
  });
}

void qgemm(const QMat& w, const Q8ActRows& a, const float* bias, float* out, int64_t ldo) {
  TORCH_CHECK(a.K == w.K, "qgemm: activations have K ", a.K, ", weights ", w.K);
  const int64_t M = a.M;
  // Threads split the weight groups: a group's weights (nb * 128 or 256 bytes) stay in L1 while the
  // activation rows stream past them. Rows go in chunks so the chunk's activations (kRowChunk * K
  // bytes) stay in L2 across the groups. On AMX a chunk is 4x longer: each pair of groups is unpacked into tile
  // layout once per chunk, and 256 rows of activations still fit L2 (2 MB on Sapphire Rapids).
#ifdef RS_AMX
  const int64_t kRowChunk = amx_usable() ? 256 : 64;
#else
  constexpr int64_t kRowChunk = 64;
#endif
  for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
    const int64_t r1 = std::min(M, r0 + kRowChunk);
    parallel_for(0, w.G, 4, [&](int64_t g0, int64_t g1) { qgemm_block(w, a, bias, out, ldo, g0, g1, r0, r1); });
  }
}

void qgemm_range(const QMat& w, const Q8ActRows& a, float* out, int64_t ldo, int64_t g0, int64_t g1, int64_t r0,
                 int64_t r1) {
  constexpr int64_t kRowChunk = 64;  // as qgemm: a chunk's activations stay in L2 across the groups
  for (int64_t c0 = r0; c0 < r1; c0 += kRowChunk) qgemm_block(w, a, nullptr, out, ldo, g0, g1, c0, std::min(r1, c0 + kRowChunk));
}

namespace {

void quant_linear_op(const at::Tensor& x, int64_t kind, int64_t n, const at::Tensor& data, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const QKindInfo* info = qkind_info(kind);
  TORCH_CHECK(info == nullptr || !info->has_min || m.has_value(), "quant_linear: ", info ? info->name : "",
              " needs its mins");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "quant_linear: x must be float32 [M, K] contiguous");
  const QMat w = qmat_from_tensors(kind, n, x.size(1), data, d, m.has_value() ? *m : d, "quant_linear");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == w.N,
              "quant_linear: out must be float32 [M, N]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.N,
                "quant_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  thread_local Q8ActRows act;
  quantize_rows_q8(x.data_ptr<float>(), M, w.K, w.K, act);
  qgemm(w, act, bp, out.data_ptr<float>(), w.N);
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("quant_linear", &radixserve::quant_linear_op);
}
