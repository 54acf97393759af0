// Paged attention on CPU (float32 compute; the KV pool in float32, bfloat16 or q8_0 blocks (kv_quant.h), widened on
// load): the kernel for short query blocks (DECODE, TARGET_VERIFY, the decodes of MIXED) and its variable-length form
// for every mode (--enable-deterministic-inference). Op schemas: ops.cpp; built per ISA by kernels/cpu/loader.py.
//
// Why it exists: the torch-native path must first copy every request's K/V history out of the
// paged pool (index_select) and then read the copy again in scaled_dot_product_attention; at
// batch 32 x context 512 that copy moved ~1.5 GB per step and cost more than all the linear
// layers together. Here each (request, kv head) reads its K and V rows once, straight from the
// pool through the slot table, so a step costs one pass over the KV history.
//
// Layout (all float32, contiguous):
//   q        [nb * L, H, D]    query rows, request-major: request b owns rows b*L .. b*L+L-1
//   k, v     [S, Hkv, D]       one layer of the KV pool; query head j reads kv head j / (H/Hkv)
//   kv_idx   [nb, max_len]     int64 slot table, row b valid for seq_lens[b] entries
//   seq_lens [nb]              int64 KV length including this step's L tokens (already written)
//   out      [nb * L, H, D]
// Query i of request b sits at position pos = seq_len - L + i and sees keys 0 .. pos, or only the last
// `window` of them (window > 0); scores are soft-capped when softcap > 0 (attn_common.h). Rows keep
// their scores relative to their first visible key, so keys outside a window are never read.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn_common.h"
#include "bf16.h"
#include "kv_quant.h"
#include "ops.h"

namespace radixserve {
namespace {

// Rows prefetched ahead of use: slots are scattered, so the hardware prefetcher cannot guess them.
constexpr int64_t kAhead = 16;

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 0x55));
  return _mm_cvtss_f32(x);
}
#endif

template <typename P>
inline float dot(const float* __restrict a, P b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 16 == 0) {  // explicit lanes: the same sums whatever the KV dtype (the compiler's own would differ)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t d = 0; d < n; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b + d + 8), a1);
    }
    return hsum(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * to_f32(b[d]);
  return s;
}

// s[g] = dot(q + g * D, k) for the G query heads that share one kv head: each K vector is loaded
// once for all of them, and the G accumulators are independent FMA chains.
template <typename P>
inline void dot_group(const float* __restrict q, P k, int64_t G, int64_t D, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv = load8(k + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g + 0) * D + d), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g + 1) * D + d), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g + 2) * D + d), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g + 3) * D + d), kv, a3);
      }
      s[g] = hsum(a0), s[g + 1] = hsum(a1), s[g + 2] = hsum(a2), s[g + 3] = hsum(a3);
    }
    for (; g < G; ++g) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), load8(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), load8(k + d + 8), a1);
      }
      for (; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), load8(k + d), a0);
      s[g] = hsum(_mm256_add_ps(a0, a1));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) s[g] = dot(q + g * D, k, D);
}

template <typename P>
inline void axpy(float* __restrict y, float a, P x, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += a * to_f32(x[d]);
}

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// acc[0:D] = sum_t p[t] * v[idx[t] * row + off : + D] over t < n: the rows no vector path takes (D % 32 != 0, or a
// build without AVX2; rows_weighted_sum takes every other)
template <typename P>
inline void weighted_sum(const float* __restrict p, P v, const int64_t* __restrict idx,
                         int64_t row, int64_t off, int64_t n, int64_t D, float* __restrict acc) {
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
  for (int64_t t = 0; t < n; ++t) axpy(acc, p[t], v + idx[t] * row + off, D);
}

#if defined(__AVX2__) && defined(__FMA__)
// Scores of NG query heads that share one kv head (and one query position, hence one visible count)
// against keys 0 .. visible - 1, for the 64 columns starting at c: each K chunk is loaded (and
// widened from bf16) once for all NG heads, 4 keys at a time as independent FMA chains. Head g's
// scores go to s0 + g * stride. Per head this is the very sequence of float operations the one-head
// loop did before (mul, then 7 fmadds per key over the chunk's 8-lane slices, then the same
// horizontal sums), so a row's scores still depend only on its own query, position and keys.
template <int NG, typename P>
inline void group_scores(const float* q, P kp, const int64_t* idx, int64_t koff, int64_t visible, int64_t D,
                         int64_t row, int64_t c, float scale, float* s0, int64_t stride) {
  int64_t t = 0;
  for (; t + 4 <= visible; t += 4) {
    if (t + kAhead + 3 < visible) {
      for (int u = 0; u < 4; ++u) prefetch_row(kp + idx[t + kAhead + u] * row + koff + c, 64);
    }
    P k0 = kp + idx[t] * row + koff + c;
    P k1 = kp + idx[t + 1] * row + koff + c;
    P k2 = kp + idx[t + 2] * row + koff + c;
    P k3 = kp + idx[t + 3] * row + koff + c;
    __m256 a[NG][4];
    {
      const __m256 x0 = load8(k0), x1 = load8(k1), x2 = load8(k2), x3 = load8(k3);
      for (int g = 0; g < NG; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + c);
        a[g][0] = _mm256_mul_ps(qv, x0);
        a[g][1] = _mm256_mul_ps(qv, x1);
        a[g][2] = _mm256_mul_ps(qv, x2);
        a[g][3] = _mm256_mul_ps(qv, x3);
      }
    }
    for (int j = 1; j < 8; ++j) {
      const __m256 x0 = load8(k0 + 8 * j), x1 = load8(k1 + 8 * j), x2 = load8(k2 + 8 * j), x3 = load8(k3 + 8 * j);
      for (int g = 0; g < NG; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + c + 8 * j);
        a[g][0] = _mm256_fmadd_ps(qv, x0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(qv, x1, a[g][1]);
        a[g][2] = _mm256_fmadd_ps(qv, x2, a[g][2]);
        a[g][3] = _mm256_fmadd_ps(qv, x3, a[g][3]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      // 4 horizontal sums at once: [a0 a1 a2 a3] -> one __m128
      const __m256 h01 = _mm256_hadd_ps(a[g][0], a[g][1]), h23 = _mm256_hadd_ps(a[g][2], a[g][3]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23);
      __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
      sum4 = _mm_mul_ps(sum4, _mm_set1_ps(scale));
      float* s = s0 + g * stride + t;
      _mm_storeu_ps(s, c == 0 ? sum4 : _mm_add_ps(_mm_loadu_ps(s), sum4));
    }
  }
  for (; t < visible; ++t) {
    for (int g = 0; g < NG; ++g) {
      const float v = dot(q + g * D + c, kp + idx[t] * row + koff + c, 64) * scale;
      float* s = s0 + g * stride;
      s[t] = c == 0 ? v : s[t] + v;
    }
  }
}

// acc rows g < NG (acc0 + g * D) = sum_t p_g[t] * V[t] over t < n, with p_g = p0 + g * pstride: the NG
// heads of one kv head at one position see the same V rows, so each V chunk is loaded and widened once
// for all of them, kV vectors (8 * kV columns) a pass. Per head and column the sum runs over t in order
// from 0 as weighted_sum's does, so neither the width nor how the heads are grouped changes a bit.
template <int NG, int kV, typename P>
inline void group_weighted_sum(const float* __restrict p0, int64_t pstride, P v,
                               const int64_t* __restrict idx, int64_t row, int64_t off, int64_t n, int64_t D,
                               float* __restrict acc0) {
  for (int64_t c = 0; c < D; c += 8 * kV) {
    __m256 a[NG][kV];
    for (int g = 0; g < NG * kV; ++g) a[g / kV][g % kV] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (t + kAhead < n) prefetch_row(v + idx[t + kAhead] * row + off + c, 8 * kV);
      P vr = v + idx[t] * row + off + c;
      __m256 x[kV];
      for (int u = 0; u < kV; ++u) x[u] = load8(vr + 8 * u);
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_set1_ps(p0[g * pstride + t]);
        for (int u = 0; u < kV; ++u) a[g][u] = _mm256_fmadd_ps(w, x[u], a[g][u]);
      }
    }
    for (int g = 0; g < NG * kV; ++g) _mm256_storeu_ps(acc0 + (g / kV) * D + c + 8 * (g % kV), a[g / kV][g % kV]);
  }
}
#endif

// The G heads in chunks of at most 4: f(integral_constant<NG>, g0) for heads g0 .. g0 + NG - 1, NG a
// compile-time count so that a chunk's accumulators live in registers
template <typename F>
inline void for_head_chunks(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

// Weighted sums of the G rows of query position i (rows r0 .. r0 + G - 1, scores strided by pstride)
// into acc + r0 * D: grouped when the layout has a vector path, else one row at a time. A chunk's heads go
// together (each V row read once), 32 columns a pass; three heads 16 on AVX2, where 32 needed 17 registers and
// GCC kept an accumulator on the stack, a store-to-load chain on every key (docs/benchmarks.md, Zen 3: 33-46 ->
// 28-31 us a call). Four heads' 16-column variant measured slower than their spills; AVX-512VL has 32 registers.
#ifdef __AVX512VL__
constexpr int kV3 = 4;
#else
constexpr int kV3 = 2;
#endif
template <typename P>
inline void rows_weighted_sum(const float* scores, int64_t pstride, P vp, const int64_t* idx, int64_t row,
                              int64_t off, int64_t visible, int64_t G, int64_t D, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 32 == 0) {
    for_head_chunks(G, [&](auto ng, int64_t g0) {
      constexpr int NG = decltype(ng)::value;
      group_weighted_sum<NG, NG == 3 ? kV3 : 4>(scores + g0 * pstride, pstride, vp, idx, row, off, visible, D,
                                                acc + g0 * D);
    });
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) weighted_sum(scores + g * pstride, vp, idx, row, off, visible, D, acc + g * D);
}

// Scores of query rows i0 <= i < i1 of one (request, kv head), row r = (i - i0) * G + g, against
// their visible keys: query i sits at position pos0 + i and sees keys keys_of(pos0 + i, window), whose
// score j (key lo + j) goes to scores + r * stride + j. q0 is the request's query row 0. The G heads of one position go
// together (group_scores: each K chunk loaded once for them), 64 columns at a time; a row's scores
// depend only on its query, its position and the keys, never on which other rows share the call.
// False when this layout has no vector path (the caller then uses dot_group).
template <typename P>
inline bool rows_scores(const float* q0, P kp, const int64_t* idx, int64_t h, int64_t i0, int64_t i1,
                        int64_t pos0, int64_t window, int64_t H, int64_t G, int64_t D, int64_t row, int64_t stride,
                        float scale, float* scores) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 64 != 0) return false;
  for (int64_t i = i0; i < i1; ++i) {
    const KeyRange keys = keys_of(pos0 + i, window);
    for_head_chunks(G, [&](auto ng, int64_t g0) {
      const float* q = q0 + (i * H + h * G + g0) * D;
      float* s0 = scores + ((i - i0) * G + g0) * stride;
      for (int64_t c = 0; c < D; c += 64) {
        group_scores<decltype(ng)::value>(q, kp, idx + keys.lo, h * D, keys.n, D, row, c, scale, s0, stride);
      }
    });
  }
  return true;
#else
  return false;
#endif
}

// The fixed-L layout of paged_attention: rows 0 .. L-1 of request b, scores strided by `stride`.
template <typename P>
inline bool row_scores(const float* qp, P kp, const int64_t* idx, int64_t b, int64_t h, int64_t L,
                       int64_t window, int64_t H, int64_t G, int64_t D, int64_t row, int64_t len, int64_t stride,
                       float scale, float* scores) {
  return rows_scores(qp + b * L * H * D, kp, idx, h, 0, L, len - L, window, H, G, D, row, stride, scale, scores);
}

// Soft-cap (softcap > 0), then exp(s[t] - max) in place over a row's n visible scores; returns 1 / their
// sum (the caller applies it at the end). Built with -ffast-math so GCC vectorises expf through
// glibc's libmvec (scalar expf was ~40% of the kernel).
inline float softmax_row(float* s, int64_t n, float softcap, float* max_out = nullptr, float* sum_out = nullptr) {
  if (softcap > 0.f) soft_cap(s, n, softcap);
  float m = s[0];
  for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - m);
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  if (max_out) *max_out = m;
  if (sum_out) *sum_out = sum;
  return 1.f / sum;
}

// The last query row (exclusive, capped at i1) of a block at positions pos0 + i that sees key t: a
// window hides key t from positions >= t + window.
inline int64_t rows_seeing_end(int64_t t, int64_t pos0, int64_t window, int64_t i1) {
  return window > 0 ? std::min(i1, t - pos0 + window) : i1;
}

inline bool kv_dtype_ok(const at::Tensor& k, const at::Tensor& v) {
  const auto t = k.scalar_type();
  return t == v.scalar_type() && (t == at::kFloat || t == at::kBFloat16 || t == at::kChar || t == at::kFloat8_e4m3fn);
}

// f(kp, vp) with the pool's element pointers: float32, bfloat16 (bf16.h), q8_0 blocks or fp8 rows (kv_quant.h)
template <typename F>
inline void with_kv(const at::Tensor& k, const at::Tensor& v, F&& f) {
  if (with_quantised_kv(k, v, f)) {
    return;
  } else if (k.scalar_type() == at::kBFloat16) {
    f(reinterpret_cast<const bf16_t*>(k.data_ptr()), reinterpret_cast<const bf16_t*>(v.data_ptr()));
  } else {
    f(k.data_ptr<float>(), v.data_ptr<float>());
  }
}

}  // namespace

void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                     const at::Tensor& seq_lens, int64_t L, double scale, int64_t window, double softcap,
                     at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "paged_attention: CPU tensors only");
  check_window_softcap("paged_attention", window, softcap);
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && kv_dtype_ok(k, v),
              "paged_attention: q and out float32, k and v both float32, bfloat16, int8 (q8_0) or fp8");
  TORCH_CHECK(kv_idx.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention: kv_idx and seq_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous() &&
                  kv_idx.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes(),
              "paged_attention: bad ranks or shapes");
  const int64_t nb = kv_idx.size(0), max_len = kv_idx.size(1);
  const int64_t H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(L >= 1 && q.size(0) == nb * L && seq_lens.size(0) == nb, "paged_attention: q rows != nb * L");
  TORCH_CHECK(kv_row_ok(k, D) && Hkv >= 1 && H % Hkv == 0, "paged_attention: head layout mismatch");
  const int64_t G = H / Hkv;
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(lp[b] >= L && lp[b] <= max_len, "paged_attention: seq_len ", lp[b], " of request ", b,
                " outside [", L, ", ", max_len, "]");
    // only the slots some query reads: those before the first row's window are never touched
    for (int64_t t = window_start(lp[b] - L, window); t < lp[b]; ++t) {
      const int64_t slot = ip[b * max_len + t];
      TORCH_CHECK(slot >= 0 && slot < S, "paged_attention: slot ", slot, " outside the pool of ", S);
    }
  }

  const int64_t row = Hkv * D;  // floats per slot: all kv heads of one token
  // Work items: (request, kv head, key chunk), request-major, so even a batch of one request uses every
  // thread; item first[b] + h * chunks[b] + c is chunk c of request b's kv head h.
  std::vector<int64_t> chunks(nb), first(nb + 1, 0);
  for (int64_t b = 0; b < nb; ++b) {
    chunks[b] = key_chunks(L, lp[b], window);
    first[b + 1] = first[b] + Hkv * chunks[b];
  }
  const int64_t items = first[nb];
  const bool split = items > nb * Hkv;
  // a split item's G rows: the max and sum of its chunk's exp(scores - max), and its unnormalised V sum
  std::vector<float> part_m(split ? items * G : 0), part_l(split ? items * G : 0), part_acc(split ? items * G * D : 0);
  with_kv(k, v, [&](auto kp, auto vp) {
  parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, inv_sum, mx, sums, sg(G);
    // Attention of request b's kv head h over its keys idx[0 .. len): L query rows at positions len - L ..,
    // each seeing keys_of(its position, window). acc gets the unnormalised V sums, inv_sum (mx, sums) the
    // rows' 1 / sum (max, sum) of exp(score - max).
    auto attend = [&](int64_t b, int64_t h, const int64_t* idx, int64_t len, int64_t nq, int64_t win) {
      const int64_t R = nq * G, pos0 = len - nq;  // row r = i * G + g: query i, head h * G + g
      // >= every row's visible count; with a window the scratch stays O(window), not O(len)
      const int64_t stride = win > 0 ? std::min(len, win) : len;
      scores.assign(R * stride, 0.f);
      acc.assign(R * D, 0.f);
      inv_sum.assign(R, 0.f);
      mx.assign(R, 0.f);
      sums.assign(R, 0.f);
      // Pass 1: scores. Query i at position pos0 + i sees keys keys_of(pos0 + i, win); its score of
      // key lo + j goes to column j.
      if (!row_scores(qp, kp, idx, b, h, nq, win, H, G, D, row, len, stride, fscale, scores.data())) {
        for (int64_t t = window_start(pos0, win); t < len; ++t) {
          if (t + kAhead < len) prefetch_row(kp + idx[t + kAhead] * row + h * D, D);
          const auto kr = kp + idx[t] * row + h * D;
          for (int64_t i = (t > pos0 ? t - pos0 : 0); i < rows_seeing_end(t, pos0, win, nq); ++i) {
            dot_group(qp + ((b * nq + i) * H + h * G) * D, kr, G, D, sg.data());  // heads h*G .. h*G+G-1
            const int64_t j = t - window_start(pos0 + i, win);
            for (int64_t g = 0; g < G; ++g) scores[(i * G + g) * stride + j] = sg[g] * fscale;
          }
        }
      }
      // Softmax of each row over its visible keys; the normaliser is applied by the caller.
      for (int64_t r = 0; r < R; ++r) {
        inv_sum[r] = softmax_row(scores.data() + r * stride, keys_of(pos0 + r / G, win).n, fcap, &mx[r], &sums[r]);
      }
      // Pass 2: weighted sum of V rows, one query row at a time with its 64-column slice of the
      // accumulator held in registers (an in-memory accumulator updated per key stalled on
      // store-to-load forwarding). Each V row is read R times, from L1/L2 after the first.
      for (int64_t i = 0; i < nq; ++i) {
        const KeyRange keys = keys_of(pos0 + i, win);
        rows_weighted_sum(scores.data() + i * G * stride, stride, vp, idx + keys.lo, row, h * D, keys.n, G, D,
                          acc.data() + i * G * D);
      }
    };
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), w) - first.begin() - 1;
      const int64_t h = (w - first[b]) / chunks[b], c = (w - first[b]) % chunks[b];
      const int64_t* idx = ip + b * max_len;
      if (chunks[b] == 1) {
        attend(b, h, idx, lp[b], L, window);
        for (int64_t r = 0; r < L * G; ++r) {
          const int64_t i = r / G, g = r % G;
          float* orow = op + ((b * L + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] = acc[r * D + d] * inv_sum[r];
        }
        continue;
      }
      // chunk c of the one decode row's visible keys: as a window-free row of its own over those keys
      const KeyRange keys = keys_of(lp[b] - 1, window);
      const int64_t lo = keys.lo + c * kSplitKeys, n = std::min(kSplitKeys, keys.n - c * kSplitKeys);
      attend(b, h, idx + lo, n, 1, 0);
      std::copy(mx.begin(), mx.begin() + G, part_m.begin() + w * G);
      std::copy(sums.begin(), sums.begin() + G, part_l.begin() + w * G);
      std::copy(acc.begin(), acc.begin() + G * D, part_acc.begin() + w * G * D);
    }
  });
  });
  if (!split) return;
  for (int64_t b = 0; b < nb; ++b) {
    if (chunks[b] == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t w0 = first[b] + h * chunks[b];
      merge_key_chunks(part_m.data() + w0 * G, part_l.data() + w0 * G, part_acc.data() + w0 * G * D, chunks[b], G, D,
                       op + (b * H + h * G) * D);  // L == 1: request b's one query row, heads h * G ..
    }
  }
}

// ---------------------------------------------------------------------------------------------
// paged_attention_varlen: every forward mode through one code path (deterministic inference).
//
//   q        [n, H, D]      query rows; request b owns rows q_start[b] .. q_start[b] + q_lens[b] - 1
//   kv_idx   [nb, max_len]  int64 slot table, row b valid for seq_lens[b] entries (this step's K/V
//                           already written there)
//   seq_lens, q_start, q_lens [nb] int64
//   out      [n, H, D]      rows not owned by any request are left untouched
// Query i of request b sits at position seq_lens[b] - q_lens[b] + i and sees keys 0 .. that position
// (causal inside the block, whole history before it), or the last `window` of them: PREFILL, EXTEND,
// DECODE, MIXED and TARGET_VERIFY are all this one rule. Work items are (request, kv head, block of
// kRowBlock query rows), so a long prompt uses every thread and the scratch stays O(kRowBlock *
// seq_len), O(kRowBlock * window) with a window.
//
// Batch invariance: a query row's result is a function of its query vector, its position, the window,
// the soft-cap and the keys/values it sees, computed by the same sequence of float operations whatever the other rows of
// the call (other requests, other rows of the block, the block length): keys are visited in
// position order with the grouping of rows_scores fixed by the row's own visible count, the softmax
// and the weighted sum run per row, and each row's score buffer starts 64-byte aligned with a
// stride rounded to 16 floats, so even a compiler's alignment peeling treats every row alike.
constexpr int64_t kRowBlock = 16;

void check_varlen_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& kv_idx, const at::Tensor& seq_lens, const at::Tensor& q_start,
                            const at::Tensor& q_lens, const at::Tensor& out, int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), op, ": CPU tensors only");
  check_window_softcap(op, window, softcap);
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && kv_dtype_ok(k, v), op,
              ": q and out float32, k and v both float32, bfloat16, int8 (q8_0) or fp8");
  TORCH_CHECK(kv_idx.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  q_start.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong,
              op, ": kv_idx, seq_lens, q_start and q_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous() &&
                  kv_idx.is_contiguous() && seq_lens.is_contiguous() && q_start.is_contiguous() &&
                  q_lens.is_contiguous(),
              op, ": contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes() &&
                  kv_idx.dim() == 2,
              op, ": bad ranks or shapes");
  const int64_t nb = kv_idx.size(0), max_len = kv_idx.size(1), n = q.size(0), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(seq_lens.numel() == nb && q_start.numel() == nb && q_lens.numel() == nb, op,
              ": seq_lens, q_start and q_lens need one entry per kv_idx row");
  TORCH_CHECK(kv_row_ok(k, q.size(2)) && Hkv >= 1 && q.size(1) % Hkv == 0, op, ": head layout mismatch");
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* sp = q_start.data_ptr<int64_t>();
  const int64_t* np = q_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(np[b] >= 0 && sp[b] >= 0 && sp[b] + np[b] <= n, op, ": query rows [", sp[b], ", ", sp[b] + np[b],
                ") of request ", b, " outside q's ", n, " rows");
    TORCH_CHECK(lp[b] >= np[b] && lp[b] <= max_len, op, ": seq_len ", lp[b], " of request ", b, " outside [", np[b],
                ", ", max_len, "]");
    // only the slots some query reads: those before the first row's window are never touched
    for (int64_t t = window_start(lp[b] - np[b], window); t < lp[b]; ++t) {
      const int64_t slot = ip[b * max_len + t];
      TORCH_CHECK(slot >= 0 && slot < S, op, ": slot ", slot, " outside the pool of ", S);
    }
  }
}

void paged_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                            const at::Tensor& seq_lens, const at::Tensor& q_start, const at::Tensor& q_lens,
                            double scale, int64_t window, double softcap, at::Tensor& out) {
  check_varlen_attention("paged_attention_varlen", q, k, v, kv_idx, seq_lens, q_start, q_lens, out, window, softcap);
  const int64_t nb = kv_idx.size(0), max_len = kv_idx.size(1);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t G = H / Hkv;
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* sp = q_start.data_ptr<int64_t>();
  const int64_t* np = q_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (request, first query row of the block)
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i0 = 0; i0 < np[b]; i0 += kRowBlock) blocks.emplace_back(b, i0);
  }
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  const int64_t row = Hkv * D;  // floats per slot: all kv heads of one token
  with_kv(k, v, [&](auto kp, auto vp) {
  parallel_for(0, nblocks * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, acc(G * D), sg(G), inv(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = blocks[w / Hkv].first, i0 = blocks[w / Hkv].second, h = w % Hkv;
      const int64_t i1 = std::min(i0 + kRowBlock, np[b]);
      const int64_t pos0 = lp[b] - np[b], R = (i1 - i0) * G;
      // >= the block's longest visible count (the last row's, or the window)
      const int64_t widest = window > 0 ? std::min(pos0 + i1, window) : pos0 + i1;
      const int64_t stride = (widest + 15) / 16 * 16;
      const int64_t* idx = ip + b * max_len;
      const float* q0 = qp + sp[b] * H * D;
      buf.resize(R * stride + 16);
      float* scores = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
      if (!rows_scores(q0, kp, idx, h, i0, i1, pos0, window, H, G, D, row, stride, fscale, scores)) {
        // No vector layout: keys outer, each visible (row, head) pair scored by dot_group, whose
        // per-head arithmetic depends only on the head's index g.
        const int64_t last = pos0 + i1;  // keys first .. last - 1 are visible to some row
        for (int64_t t = window_start(pos0 + i0, window); t < last; ++t) {
          if (t + kAhead < last) prefetch_row(kp + idx[t + kAhead] * row + h * D, D);
          const auto kr = kp + idx[t] * row + h * D;
          for (int64_t i = std::max(i0, t - pos0); i < rows_seeing_end(t, pos0, window, i1); ++i) {
            dot_group(q0 + (i * H + h * G) * D, kr, G, D, sg.data());
            const int64_t j = t - window_start(pos0 + i, window);
            for (int64_t g = 0; g < G; ++g) scores[((i - i0) * G + g) * stride + j] = sg[g] * fscale;
          }
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        const KeyRange keys = keys_of(pos0 + i, window);
        float* s0 = scores + (i - i0) * G * stride;
        for (int64_t g = 0; g < G; ++g) inv[g] = softmax_row(s0 + g * stride, keys.n, fcap);
        rows_weighted_sum(s0, stride, vp, idx + keys.lo, row, h * D, keys.n, G, D, acc.data());
        for (int64_t g = 0; g < G; ++g) {
          float* orow = op + ((sp[b] + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] = acc[g * D + d] * inv[g];
        }
      }
    }
  });
  });
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("paged_attention", &radixserve::paged_attention);
  m.impl("paged_attention_varlen", &radixserve::paged_attention_varlen);
}
