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

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace radixserve {

// The writers are built without -ffast-math (which the kernels use): it may turn `amax / 127.f` into a multiply by
// the reciprocal, one ulp away from the division PyTorch's writer does, and the rows must be the same bits.
#define RADIXSERVE_EXACT_MATH __attribute__((optimize("no-fast-math")))


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

// --kv-cache-dtype fp8_e4m3: each (slot, kv head) row is a float32 scale then D float8 e4m3 values (value = scale
// * e4m3; the scale per head and token, amax / 448), in a float8_e4m3fn tensor [S, Hkv, D + 4]. D is a power of two
// (the row index of an element is a shift) and a multiple of 8 (an 8-wide load stays in one row).
struct F8P {
  const uint8_t* base;  // the layer tensor's first byte
  int64_t e;            // element index in the logical [S, Hkv, D] layout
  int shift;            // log2(D)
  F8P operator+(int64_t n) const { return {base, e + n, shift}; }
  const uint8_t* row() const { return base + (e >> shift) * ((int64_t{1} << shift) + 4); }
  int64_t col() const { return e & ((int64_t{1} << shift) - 1); }
  float operator[](int64_t i) const;
};

// the 256 float8 e4m3 values as float32, built once (c10's conversion: the bits torch's .float() gives)
inline const float* f8_table() {
  static const float* table = [] {
    static float t[256];
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b),
                                                                                  c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

inline float f8_scale(const uint8_t* row) {
  float s;
  std::memcpy(&s, row, sizeof(s));
  return s;
}

inline float F8P::operator[](int64_t i) const {
  const F8P p = *this + i;
  const uint8_t* r = p.row();
  return f8_table()[r[4 + p.col()]] * f8_scale(r);
}

inline void prefetch_row(F8P p, int64_t n) {
  const uint8_t* first = p.row();
  const uint8_t* last = (p + (n - 1)).row() + (int64_t{1} << p.shift) + 4;
  for (const uint8_t* c = first; c < last; c += 64) __builtin_prefetch(c);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(F8P p) {
  const uint8_t* r = p.row();
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 4 + p.col())));
  return _mm256_mul_ps(_mm256_i32gather_ps(f8_table(), idx, 4), _mm256_set1_ps(f8_scale(r)));
}
#endif

inline int f8_shift(int64_t D) {
  int s = 0;
  while ((int64_t{1} << s) < D) ++s;
  return s;
}

// src[0:n] (n a multiple of D) -> the rows of elements e0 .. e0 + n (e0 % D == 0): per row amax / 448, values
// x / scale rounded to e4m3 (c10's conversion, the one torch's .to(float8_e4m3fn) uses)
RADIXSERVE_EXACT_MATH inline void store_row_f8(uint8_t* base, int64_t e0, const float* src, int64_t n, int64_t D) {
  const int shift = f8_shift(D);
  for (int64_t j = 0; j < n; j += D) {
    uint8_t* r = base + ((e0 + j) >> shift) * (D + 4);
    float amax = 0.f;
    for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(src[j + i]));
    const float s = amax / 448.f;
    std::memcpy(r, &s, sizeof(s));
    for (int64_t i = 0; i < D; ++i) r[4 + i] = c10::Float8_e4m3fn(s > 0.f ? src[j + i] / s : 0.f).x;
  }
}

// Whether a layer tensor k [S, Hkv, last] holds rows of D values: last == D, an int8 layer's q8_0 blocks, or an
// fp8 layer's scaled rows.
template <typename Tensor>
inline bool kv_row_ok(const Tensor& k, int64_t D) {
  if (k.scalar_type() == c10::ScalarType::Char) return D % kQ8Block == 0 && k.size(2) == D / kQ8Block * kQ8Bytes;
  if (k.scalar_type() == c10::ScalarType::Float8_e4m3fn) return D >= 8 && (D & (D - 1)) == 0 && k.size(2) == D + 4;
  return k.size(2) == D;
}

// f(kp, vp) with a quantised layer's element pointers (q8_0 or fp8); false for float / bf16 layers
template <typename Tensor, typename F>
inline bool with_quantised_kv(const Tensor& k, const Tensor& v, F&& f) {
  if (k.scalar_type() == c10::ScalarType::Char) {
    f(Q8P{k.template data_ptr<int8_t>(), 0}, Q8P{v.template data_ptr<int8_t>(), 0});
    return true;
  }
  if (k.scalar_type() == c10::ScalarType::Float8_e4m3fn) {
    const int shift = f8_shift(k.size(2) - 4);
    f(F8P{static_cast<const uint8_t*>(k.data_ptr()), 0, shift}, F8P{static_cast<const uint8_t*>(v.data_ptr()), 0, shift});
    return true;
  }
  return false;
}

// src[0:n] (n % 32 == 0) -> the blocks of elements e0 .. e0 + n (e0 % 32 == 0) of the layer at base
RADIXSERVE_EXACT_MATH inline void store_row_q8(int8_t* base, int64_t e0, const float* src, int64_t n) {
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
