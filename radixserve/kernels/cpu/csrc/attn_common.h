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

}  // namespace radixserve
