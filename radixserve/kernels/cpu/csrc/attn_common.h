// What a layer's attention computes beyond plain causal softmax, shared by every attention kernel
// (paged_attention.cpp, flash_attention.cpp), as radixserve/layers/radix_attention.py defines it:
//   window W (0 = global)    a query at position pos sees keys lo .. pos, lo = max(0, pos - W + 1)
//   softcap c (0 = none)     a score s (already scaled) becomes c * tanh(s / c) before the softmax
// Kernels start their key loops at lo, so keys outside a window are never read (a local layer's
// cost stays flat as the context grows), and skip the cap entirely at c = 0, so with both off every
// row runs exactly the float operations it ran before these options existed.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixserve {

// The first key a query at position pos sees.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The keys a query at position pos sees: lo .. lo + n - 1 (n >= 1: it always sees itself).
struct KeyRange {
  int64_t lo, n;
};
inline KeyRange keys_of(int64_t pos, int64_t window) {
  const int64_t lo = window_start(pos, window);
  return {lo, pos - lo + 1};
}

// s[0 .. n-1] = cap * tanh(s / cap), in place (cap > 0).
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
}

// The kernels are built with -ffast-math, under which the compiler may assume no NaN or infinity
// and fold away a comparison meant to catch one: test the exponent bits instead.
inline bool is_finite_bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return ((u >> 52) & 0x7FF) != 0x7FF;
}

// The argument rule for window / softcap, naming the op `op` in the error.
inline void check_window_softcap(const char* op, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 0 (0 = global attention), got ", window);
  TORCH_CHECK(is_finite_bits(softcap) && softcap >= 0.0, op,
              ": softcap must be a finite number >= 0 (0 = no soft-cap), got ", softcap);
}

// A decode row (L == 1) that sees more than kSplitKeys keys is split into kSplitKeys-key chunks, each its own
// work item, merged in chunk order (flash-decoding's split-K): one item per (request, kv head) left a model
// with one kv head (Gemma 3) at a long context, batch 1, attending on one thread. The split depends only on
// the row's own visible count, so a row's result never depends on its batch or the thread count, and rows
// of up to kSplitKeys keys keep the one-pass arithmetic bit for bit.
constexpr int64_t kSplitKeys = 1024;

inline int64_t key_chunks(int64_t L, int64_t len, int64_t window) {
  const int64_t n = L == 1 ? keys_of(len - 1, window).n : 0;
  return n > kSplitKeys ? (n + kSplitKeys - 1) / kSplitKeys : 1;
}

// Merge `nc` key chunks' partial results of G rows (chunk c, row g: max m[c * G + g], sum l[c * G + g] of
// exp(score - max), unnormalised V sum acc[(c * G + g) * D ..]) in chunk order into out[g * D ..]:
// sum_c e_c acc_c / sum_c e_c l_c with e_c = exp(m_c - max_c m_c).
inline void merge_key_chunks(const float* m, const float* l, const float* acc, int64_t nc, int64_t G, int64_t D,
                             float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mm = m[g];
    for (int64_t c = 1; c < nc; ++c) mm = std::max(mm, m[c * G + g]);
    float sum = 0.f;
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < nc; ++c) {
      const float e = std::exp(m[c * G + g] - mm);
      sum += e * l[c * G + g];
      const float* a = acc + (c * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += e * a[d];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

}  // namespace radixserve
