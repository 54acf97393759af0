// The 8-bit KV cache (--kv-cache-dtype int8): llama.cpp's q8_0 blocks, read in place by the attention kernels.
//
// One layer's K (or V) is an int8 tensor [S, Hkv, D / 32 * 34]: each (slot, kv head) row of D values is D / 32
// blocks of 34 bytes, a float16 scale d then 32 int8 values q, value = d * q (8.5 bits a value, as ggml's
// block_q8_0 and llama.cpp's -ctk/-ctv q8_0). Kernels address a layer as if it were [S, Hkv, D] elements through
// Q8P, a pointer that keeps the element index: `p + n` moves it, load8 / operator[] find the block and scale.
// Requires D % 32 == 0, so every row starts a block and the kernels' 8-wide loads never straddle one.
//
// Quantisation (store_row_q8) is ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(x / d) (half away from
// zero), d stored as float16 (round to nearest even); the PyTorch writer (mem_cache/kv_quant.py) computes the
// very same bits.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace radixserve {

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Bytes = 34;

inline float q8_half_to_f32(const int8_t* blk) {
  uint16_t h;
  std::memcpy(&h, blk, sizeof(h));
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

struct Q8P {
  const int8_t* base;  // the layer tensor's first byte
  int64_t e;           // element index in the logical [S, Hkv, D] layout
  Q8P operator+(int64_t n) const { return {base, e + n}; }
  const int8_t* block() const { return base + (e >> 5) * kQ8Bytes; }
  float operator[](int64_t i) const {
    const Q8P p = *this + i;
    const int8_t* b = p.block();
    return q8_half_to_f32(b) * static_cast<float>(b[2 + (p.e & 31)]);
  }
};


inline void prefetch_row(Q8P p, int64_t n) {
  const int8_t* first = p.block();
  const int8_t* last = (p + (n - 1)).block() + kQ8Bytes;
  for (const int8_t* c = first; c < last; c += 64) __builtin_prefetch(c);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 consecutive elements (inside one block) as float32
inline __m256 load8(Q8P p) {
  const int8_t* b = p.block();
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + (p.e & 31)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(q8_half_to_f32(b)));
}
#endif

// Whether a layer tensor k [S, Hkv, last] holds rows of D values: last == D, or an int8 layer's q8_0 blocks.
template <typename Tensor>
inline bool kv_row_ok(const Tensor& k, int64_t D) {
  if (k.scalar_type() == c10::ScalarType::Char) return D % kQ8Block == 0 && k.size(2) == D / kQ8Block * kQ8Bytes;
  return k.size(2) == D;
}

// src[0:n] (n % 32 == 0) -> the blocks of elements e0 .. e0 + n (e0 % 32 == 0) of the layer at base
inline void store_row_q8(int8_t* base, int64_t e0, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; j += kQ8Block) {
    int8_t* blk = base + ((e0 + j) >> 5) * kQ8Bytes;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(src[j + i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = c10::Half(d).x;
    std::memcpy(blk, &h, sizeof(h));
    for (int64_t i = 0; i < kQ8Block; ++i) blk[2 + i] = static_cast<int8_t>(std::round(src[j + i] * id));
  }
}

}  // namespace radixserve
