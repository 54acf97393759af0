// The decoder layer's glue on CPU (float32): fused residual-add + RMSNorm, RoPE in place, SiLU- and
// GELU-tanh-and-mul; the greedy sampler's argmax over each row of logits; and the embedding lookup of a GGUF
// Q8_0 token table read in place.
// Op schemas: ops.cpp; built per CPU ISA by radixserve/kernels/cpu/loader.py.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kv_quant.h"
#include "ops.h"

namespace radixserve {

// ---------------------------------------------------------------------------------------------
// Decoder-layer glue. At batch 1 a 30-layer decode step ran ~60 small torch ops for the norms
// alone (torch.rms_norm on CPU is a composite of pow/mean/rsqrt/mul, each an OpenMP region):
// ~7 ms of an ~80 ms step on the reference machine. One loop each here.

// residual += x (if has_residual); x = rms_norm(residual or x) * weight. In place, row by row.
void fused_add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x must be contiguous [n, hidden] and weight [hidden]");
  float* r = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == at::kFloat,
                "rms_norm: residual must match x");
    r = residual->data_ptr<float>();
  }
  const int64_t n = x.size(0), h = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * h;
      float* src = xr;
      if (r != nullptr) {
        float* rr = r + i * h;
#pragma omp simd
        for (int64_t d = 0; d < h; ++d) rr[d] += xr[d];
        src = rr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < h; ++d) ss += src[d] * src[d];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + feps);
#pragma omp simd
      for (int64_t d = 0; d < h; ++d) xr[d] = src[d] * inv * w[d];
    }
  });
}

// Rotate-half RoPE in place on x [n, heads, D] (rows may be strided: a view into the qkv output).
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos_cache.scalar_type() == at::kFloat, "rope: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: x must be [n, heads, D] "
              "with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "rope: positions must be int64 [n]");
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == half &&
                  sin_cache.sizes() == cos_cache.sizes(),
              "rope: caches must be [max_pos, D/2]");
  const int64_t max_pos = cos_cache.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, "rope: position ", pp[i], " out of range");
  float* xp = x.data_ptr<float>();
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + pp[i] * half;
      const float* s = sp + pp[i] * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        float* v = xp + i * row + hd * D;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = v[d], b = v[d + half];
          v[d] = a * c[d] - b * s[d];
          v[d + half] = b * c[d] + a * s[d];
        }
      }
    }
  });
}

// out [n, I] = act(x[:, :I]) * x[:, I:] for x [n, 2I] contiguous: the gated MLP's activation.
template <typename Act>
void gated_and_mul(const char* op, const at::Tensor& x, at::Tensor& out, Act act) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, op, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && x.size(1) == 2 * out.size(1) &&
                  out.size(0) == x.size(0),
              op, ": x [n, 2I] and out [n, I], contiguous");
  const int64_t n = x.size(0), I = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = xp + i * 2 * I;
      const float* u = g + I;
      float* o = outp + i * I;
#pragma omp simd
      for (int64_t d = 0; d < I; ++d) o[d] = act(g[d]) * u[d];
    }
  });
}

void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  gated_and_mul("silu_and_mul", x, out, [](float g) { return g / (1.f + std::exp(-g)); });
}

// GELU with the tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). layers/activation.py's GeluTanhAndMul calls this
// op too, so the layer-by-layer path and the decode stack compute the same floats.
void gelu_tanh_and_mul(const at::Tensor& x, at::Tensor& out) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  gated_and_mul("gelu_tanh_and_mul", x, out, [](float g) {
    return 0.5f * g * (1.f + std::tanh(kBeta * (g + kKappa * g * g * g)));
  });
}

// ---------------------------------------------------------------------------------------------
// Greedy sampling: torch.argmax(logits, -1) exactly (the first maximum; the first NaN where a row has one;
// -0.0 equals +0.0), from the bits, so -ffast-math (which may assume no NaN) cannot change a comparison. A
// float's bits as a signed int, with the negative ones flipped, order as the floats do. On a Zen 3, torch.argmax
// (an index-tracking reduction) took 52-89 us over 49,152 logits, this 11 us: one vectorised pass finds the largest
// key and the NaNs, a second the first index holding it (the generic variant: the same passes, one value at a time).
namespace {
inline int32_t order_key(uint32_t b) {
  if (b == 0x80000000u) b = 0;  // -0.0 is +0.0
  return static_cast<int32_t>(b ^ ((static_cast<uint32_t>(static_cast<int32_t>(b) >> 31)) & 0x7fffffffu));
}
inline bool is_nan_bits(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }

int64_t argmax_row(const uint32_t* bits, int64_t n) {
  int32_t best = INT32_MIN;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  // 8 lanes: key = bits ^ ((bits >> 31) & 0x7fffffff), -0.0's key zeroed; NaN: |bits| > inf's bits
  const __m256i low31 = _mm256_set1_epi32(0x7fffffff), neg0 = _mm256_set1_epi32(INT32_MIN),
                inf = _mm256_set1_epi32(0x7f800000);
  auto keys8 = [&](const uint32_t* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i k = _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), low31));
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(b, neg0), k);
  };
  auto nan8 = [&](const uint32_t* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_cmpgt_epi32(_mm256_and_si256(b, low31), inf);
  };
  __m256i mx = _mm256_set1_epi32(INT32_MIN), nn = _mm256_setzero_si256();
  for (; i + 8 <= n; i += 8) {
    mx = _mm256_max_epi32(mx, keys8(bits + i));
    nn = _mm256_or_si256(nn, nan8(bits + i));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), mx);
  for (int l = 0; l < 8; ++l) best = std::max(best, lanes[l]);
  nan = !_mm256_testz_si256(nn, nn);
#endif
  for (; i < n; ++i) {
    best = std::max(best, order_key(bits[i]));
    nan = nan || is_nan_bits(bits[i]);
  }
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i want = _mm256_set1_epi32(best);
  for (; j + 8 <= n; j += 8) {
    const __m256i hit = nan ? nan8(bits + j) : _mm256_cmpeq_epi32(keys8(bits + j), want);
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(hit));
    if (mask) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; j < n; ++j)
    if (nan ? is_nan_bits(bits[j]) : order_key(bits[j]) == best) return j;
  return 0;  // unreachable for n >= 1
}
}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) >= 1,
              "greedy_argmax: logits must be float32 [rows, vocab >= 1] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const uint32_t* base = static_cast<const uint32_t*>(logits.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
  parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) o[r] = argmax_row(base + r * ld, n);
  });
  return out;
}

// The rows `ids` of a Q8_0 table (blocks uint8 [rows, K / 32 * 34]: llama.cpp's q8_0 blocks as kv_quant.h reads
// them, the GGUF file's bytes, mapped) as float32 [n, K]: scale x value, exact in float32 (11 x 7 significant bits),
// so the values are gguf's reference dequantisation's. The numpy path cost ~0.05 ms a batch-1 decode step.
void embedding_q8_0(const at::Tensor& blocks, const at::Tensor& ids, at::Tensor& out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) > 0 && blocks.size(1) % kQ8Bytes == 0,
              "embedding_q8_0: blocks must be uint8 [rows, K / 32 * 34], contiguous");
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1), nblk = row_bytes / kQ8Bytes, K = nblk * kQ8Block;
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "embedding_q8_0: ids must be int64 [n], contiguous");
  const int64_t n = ids.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == K,
              "embedding_q8_0: out must be float32 [", n, ", ", K, "], contiguous");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "embedding_q8_0: token id ", id[i], " outside the table's ", rows, " rows");
  }
  const int8_t* base = reinterpret_cast<const int8_t*>(blocks.data_ptr<uint8_t>());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nblk; ++b) {
      const int8_t* blk = base + id[i] * row_bytes + b * kQ8Bytes;
      const float d = q8_half_to_f32(blk);
      float* dst = o + i * K + b * kQ8Block;
      for (int64_t j = 0; j < kQ8Block; ++j) dst[j] = static_cast<float>(blk[2 + j]) * d;
    }
  }
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("embedding_q8_0", &radixserve::embedding_q8_0);
  m.impl("greedy_argmax", &radixserve::greedy_argmax);
  m.impl("fused_add_rms_norm_", &radixserve::fused_add_rms_norm_);
  m.impl("rope_", &radixserve::rope_);
  m.impl("silu_and_mul", &radixserve::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &radixserve::gelu_tanh_and_mul);
}
