// bfloat16 storage for float32 compute: the KV cache may hold bf16 (--kv-cache-dtype bfloat16), which
// halves the bytes a decode step streams from it; every kernel widens to float32 on load, which is
// exact (a bf16 is the upper half of a float32), and narrows with round-to-nearest-even on store, as
// torch's own float -> bfloat16 conversion does for finite values (so K/V written here and by the
// PyTorch path are the same bits).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace radixserve {

using bf16_t = uint16_t;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline bf16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<bf16_t>(u >> 16);
}

inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_row(bf16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 consecutive elements as float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace radixserve
