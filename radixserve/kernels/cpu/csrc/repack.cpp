// repack_kquant / repack_legacy: a GGUF K-quant (legacy) tensor's raw block rows straight into the kernels' layout (quant_linear.h;
// layers/quantization/qweight.py: QuantWeight.from_rows with the factored scale records of scale_factors.py), in
// one pass over the mapped file's bytes, the rows' 8-row groups spread over the threads.
//
//   Q4_K (144-byte blocks: d, dmin, 12 bytes of 6-bit scales / mins, 128 bytes of nibbles) -> kind Q4_1:
//     data  [G, nb * 128]  per 32-block, (quarter t < 4, row i < 8, byte c < 4) = q[8t + c] | q[8t + 4 + c] << 4
//     d     [G, nj * 96]   per super-block: the 8 rows' float32 d, then int8 sc (sub-block s < 8, row i)
//     m     [G, nj * 96]   the same with -dmin and the 6-bit mins
//   Q6_K (210-byte blocks: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 scales, d) -> kind Q6:
//     data  [G, nb * 192]  per 32-block the low nibbles as above, then two 32-byte planes p of top bits:
//                          (p, row i, byte c) holds bits 4-5 of element 8t + 4h + c at bits 4(t - 2p) + 2h
//     d     [G, nj * 160]  the 8 rows' float32 d, then int8 scales (sub-block s < 16, row i)
//
//   A stack mixing the two (Q4_K_M's q/k in Q4_K, v in Q6_K) takes their join, kind Q8_M16 (qweight.join_kinds):
//     data  [G, nb * 256]  per 32-block (quarter t < 8, row i < 8, byte c < 4) = int8 element 4t + c: Q4_K's
//                          nibble as 0..15, Q6_K's value - 32
//     d, m  [G, nj * 160]  as Q6 above with 16 int8 subs; Q4_K's sub-scale / min of 32 repeated for both of its
//                          16-halves, Q6_K's min record all zero (promote(): m_super = m_sub = 0)
//
// repack_legacy: llama.cpp's legacy types, the file's float16 scales kept as float16 (qweight._half_if_exact):
//   Q4_0 (18-byte blocks: d, 16 bytes of nibbles; w = d (q - 8)) -> kind Q4_1 with m = -8 d
//   Q4_1 (20-byte blocks: d, m, 16 bytes of nibbles)             -> kind Q4_1
//     data  [G, nb * 128]  as Q4_K's above;  d, m  [G, nb * 8] float16 (block, row)
//   Q8_0 (34-byte blocks: d, 32 int8)                             -> kind Q8_0
//     data  [G, nb * 256]  (quarter t < 8, row i < 8, byte c < 4) = element 4t + c;  d  [G, nb * 8] float16
//
// Every byte equals the Python path's (tests/layers/test_gguf_formats.py checks it on random blocks): that path
// is ~10 numpy / torch passes over one byte a weight (an 8B file: ~45 s on two cores), this one reads each block
// once. A float16 scale that is inf / NaN makes it return false without writing a guarantee: the Python path
// then decides (it keeps flat scales where factored ones would not reproduce the products bit for bit).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace radixserve {
namespace {

constexpr int kRows = 8;  // rows per interleaved group (quant_linear.h kQRows)

inline bool finite_f16(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

// IEEE half -> float, exactly (subnormals included), without F16C: every ISA variant runs it
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline void store_f32(uint8_t* p, float f) { std::memcpy(p, &f, 4); }

// Q4_K's 6-bit scale and min of sub-block s (ggml's get_scale_min_k4)
inline void k4_scale_min(const uint8_t* sc12, int s, uint8_t* sc, uint8_t* mn) {
  if (s < 4) {
    *sc = sc12[s] & 63;
    *mn = sc12[s + 4] & 63;
  } else {
    *sc = (sc12[s + 4] & 0x0F) | ((sc12[s - 4] >> 6) << 4);
    *mn = (sc12[s + 4] >> 4) | ((sc12[s] >> 6) << 4);
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Four bytes at a time (SWAR): the byte-by-byte loops this replaced repacked Q6_K at 0.4 GB/s of file on two cores
// (an 8B Q4_K_M's repack was ~5 s of its start). A 32-bit shift moves bits across byte borders only where the
// mask then clears them, and every value stays within its byte.
constexpr uint32_t kLow4 = 0x0F0F0F0Fu, kLow2 = 0x03030303u;

// The four value bytes (c < 4) of (src[c] >> shift) & 15
inline uint32_t nibbles4(const uint8_t* src, int shift) { return (load_u32(src) >> shift) & kLow4; }

// One row's 32-block as quant_linear's nibble bytes, value e being (src[e] >> shift) & 15: byte (t, c) at
// out[t * 32 + c] (the row's lane is `out` + 4 i) = value(8t + c) | value(8t + 4 + c) << 4
inline void put_nibbles(const uint8_t* src, int shift, uint8_t* out) {
  for (int t = 0; t < 4; ++t) store_u32(out + t * 32, nibbles4(src + 8 * t, shift) | nibbles4(src + 8 * t + 4, shift) << 4);
}

// Q4_K's element 32 s + e is nibble (s & 1) of qs[32 (s / 2) + e]: sub-block s reads 32 bytes from here, shifted
inline const uint8_t* q4_k_sub(const uint8_t* blk, int s) { return blk + 16 + 32 * (s / 2); }
inline int q4_k_shift(int s) { return 4 * (s & 1); }

// Q6_K's element 128 h + r: low 4 bits in ql[64 h + r % 64] >> 4 (r / 64), top 2 in qh[32 h + r % 32] >> 2 (r / 32).
// So the 32-block b (h = b / 4, bb = b % 4) reads its low bits from 32 bytes of ql shifted by 4 (bb / 2) and its top
// bits from 32 bytes of qh shifted by 2 bb.
inline const uint8_t* q6_k_low(const uint8_t* blk, int b) { return blk + 64 * (b / 4) + 32 * (b % 4 & 1); }
inline int q6_k_low_shift(int b) { return 4 * (b % 4 >> 1); }
inline const uint8_t* q6_k_top(const uint8_t* blk, int b) { return blk + 128 + 32 * (b / 4); }
inline uint32_t top4(const uint8_t* src, int b) { return (load_u32(src) >> 2 * (b % 4)) & kLow2; }

// Per byte, the int8 v - 32 of v in 0..63: v ^ 0x20 where bit 5 is set; where it is clear, v + 224 = v ^ 0xE0
inline uint32_t minus32(uint32_t v) {
  const uint32_t clear5 = ~v & 0x20202020u;
  return v ^ 0x20202020u ^ clear5 << 1 ^ clear5 << 2;
}

void repack_q4_k_group(const uint8_t* raw, int64_t row_bytes, int64_t nj, uint8_t* data, uint8_t* d, uint8_t* m) {
  for (int64_t j = 0; j < nj; ++j) {
    uint8_t* drec = d + j * 96;
    uint8_t* mrec = m + j * 96;
    for (int i = 0; i < kRows; ++i) {
      const uint8_t* blk = raw + i * row_bytes + j * 144;
      store_f32(drec + 4 * i, f16_to_f32(load_u16(blk)));
      store_f32(mrec + 4 * i, -f16_to_f32(load_u16(blk + 2)));
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, mn;
        k4_scale_min(blk + 4, s, &sc, &mn);
        drec[32 + s * kRows + i] = sc;
        mrec[32 + s * kRows + i] = mn;
      }
      for (int s = 0; s < 8; ++s) put_nibbles(q4_k_sub(blk, s), q4_k_shift(s), data + (j * 8 + s) * 128 + i * 4);
    }
  }
}

void repack_q6_k_group(const uint8_t* raw, int64_t row_bytes, int64_t nj, uint8_t* data, uint8_t* d) {
  for (int64_t j = 0; j < nj; ++j) {
    uint8_t* drec = d + j * 160;
    for (int i = 0; i < kRows; ++i) {
      const uint8_t* blk = raw + i * row_bytes + j * 210;
      store_f32(drec + 4 * i, f16_to_f32(load_u16(blk + 208)));
      for (int s = 0; s < 16; ++s) drec[32 + s * kRows + i] = blk[192 + s];
      for (int b = 0; b < 8; ++b) {
        uint8_t* out = data + (j * 8 + b) * 192 + i * 4;
        put_nibbles(q6_k_low(blk, b), q6_k_low_shift(b), out);
        // plane p, byte c: bits 4-5 of element 8t + 4h + c (t = 2p + tt) at bits 4 tt + 2 h
        const uint8_t* top = q6_k_top(blk, b);
        for (int p = 0; p < 2; ++p) {
          uint32_t word = 0;
          for (int tt = 0; tt < 2; ++tt) {
            for (int h = 0; h < 2; ++h) word |= top4(top + 8 * (2 * p + tt) + 4 * h, b) << (4 * tt + 2 * h);
          }
          store_u32(out + 128 + p * 32, word);
        }
      }
    }
  }
}

// one 8-row group of Q4_K or Q6_K rows as Q8_M16 (the join of a mixed stack; see the header)
void repack_m16_group(const uint8_t* raw, bool q4k, int64_t row_bytes, int64_t nj, uint8_t* data, uint8_t* d,
                      uint8_t* m) {
  for (int64_t j = 0; j < nj; ++j) {
    uint8_t* drec = d + j * 160;
    uint8_t* mrec = m + j * 160;
    for (int i = 0; i < kRows; ++i) {
      if (q4k) {
        const uint8_t* blk = raw + i * row_bytes + j * 144;
        store_f32(drec + 4 * i, f16_to_f32(load_u16(blk)));
        store_f32(mrec + 4 * i, -f16_to_f32(load_u16(blk + 2)));
        for (int s = 0; s < 8; ++s) {
          uint8_t sc, mn;
          k4_scale_min(blk + 4, s, &sc, &mn);
          drec[32 + (2 * s) * kRows + i] = drec[32 + (2 * s + 1) * kRows + i] = sc;
          mrec[32 + (2 * s) * kRows + i] = mrec[32 + (2 * s + 1) * kRows + i] = mn;
        }
        for (int b = 0; b < 8; ++b) {  // 32-block b (element 4t + c at out[t * 32 + c]): Q4_K's sub-block b
          uint8_t* out = data + (j * 8 + b) * 256 + i * 4;
          for (int t = 0; t < 8; ++t) store_u32(out + t * 32, nibbles4(q4_k_sub(blk, b) + 4 * t, q4_k_shift(b)));
        }
      } else {
        const uint8_t* blk = raw + i * row_bytes + j * 210;
        store_f32(drec + 4 * i, f16_to_f32(load_u16(blk + 208)));
        store_f32(mrec + 4 * i, 0.0f);
        for (int s = 0; s < 16; ++s) {
          drec[32 + s * kRows + i] = blk[192 + s];
          mrec[32 + s * kRows + i] = 0;
        }
        for (int b = 0; b < 8; ++b) {  // Q6_K's value - 32 as int8
          uint8_t* out = data + (j * 8 + b) * 256 + i * 4;
          const uint8_t *low = q6_k_low(blk, b), *top = q6_k_top(blk, b);
          for (int t = 0; t < 8; ++t) {
            store_u32(out + t * 32, minus32(nibbles4(low + 4 * t, q6_k_low_shift(b)) | top4(top + 4 * t, b) << 4));
          }
        }
      }
    }
  }
}

bool finite_scales(const uint8_t* src, int64_t n, int64_t row_bytes, bool q4k) {
  const int64_t block = q4k ? 144 : 210;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < row_bytes / block; ++j) {
      const uint8_t* blk = src + r * row_bytes + j * block;
      if (q4k ? !(finite_f16(load_u16(blk)) && finite_f16(load_u16(blk + 2))) : !finite_f16(load_u16(blk + 208)))
        return false;
    }
  }
  return true;
}

// a float known to be a float16 value (a product of one by a power of two) as its float16 bits; false where it
// is not one (overflow, or bits below float16's precision): the caller then leaves the tensor to Python
inline bool f32_to_f16_exact(float f, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000, exp = (bits >> 23) & 0xFF, man = bits & 0x7FFFFF;
  if (exp == 0 && man == 0) {
    *out = static_cast<uint16_t>(sign);
    return true;
  }
  if (exp == 0 || exp == 255) return false;  // a float32 subnormal (below float16's range), inf or NaN
  const int e = static_cast<int>(exp) - 127;
  if (e > 15) return false;
  if (e >= -14) {
    if (man & 0x1FFF) return false;
    *out = static_cast<uint16_t>(sign | static_cast<uint32_t>(e + 15) << 10 | man >> 13);
    return true;
  }
  const int shift = 13 + (-14 - e);
  if (shift >= 24) return false;
  const uint32_t full = 0x800000 | man;
  if (full & ((1u << shift) - 1)) return false;
  *out = static_cast<uint16_t>(sign | full >> shift);
  return true;
}

inline void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

}  // namespace

bool repack_legacy(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d,
                   const c10::optional<at::Tensor>& m) {
  constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "repack_legacy: ggml type ", qtype,
              " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "repack_legacy: raw must be "
              "contiguous uint8 [rows, row bytes]");
  const int64_t block = qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : 34, bb = qtype == kQ8_0 ? 256 : 128;
  const int64_t n = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK(n % kRows == 0 && row_bytes % block == 0, "repack_legacy: ", n, " rows of ", row_bytes,
              " bytes are not whole 8-row groups of whole blocks");
  const int64_t g = n / kRows, nb = row_bytes / block;
  auto check_out = [&](const at::Tensor& t, int64_t cols, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 2 && t.size(0) == g &&
                t.size(1) == cols, "repack_legacy: ", what, " must be contiguous uint8 [", g, ", ", cols, "]");
  };
  check_out(data, nb * bb, "data");
  check_out(d, nb * 16, "d");  // float16 [G, nb * 8] seen as bytes
  TORCH_CHECK(m.has_value() == (qtype != kQ8_0), "repack_legacy: Q4_0 and Q4_1 have mins, Q8_0 none");
  if (m.has_value()) check_out(*m, nb * 16, "m");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  // every scale finite, and Q4_0's -8 d a float16 value, or the caller's general path decides
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = src + r * row_bytes + j * block;
      uint16_t h;
      if (!finite_f16(load_u16(blk)) || (qtype == kQ4_1 && !finite_f16(load_u16(blk + 2))) ||
          (qtype == kQ4_0 && !f32_to_f16_exact(-8.0f * f16_to_f32(load_u16(blk)), &h)))
        return false;
    }
  }
  uint8_t *dst = data.data_ptr<uint8_t>(), *dd = d.data_ptr<uint8_t>();
  uint8_t* mm = m.has_value() ? m->data_ptr<uint8_t>() : nullptr;
  parallel_for(0, g, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t gi = lo; gi < hi; ++gi) {
      for (int i = 0; i < kRows; ++i) {
        const uint8_t* row = src + (gi * kRows + i) * row_bytes;
        for (int64_t j = 0; j < nb; ++j) {
          const uint8_t* blk = row + j * block;
          uint8_t* drec = dd + gi * nb * 16 + (j * kRows + i) * 2;
          store_u16(drec, load_u16(blk));
          uint8_t* out = dst + (gi * nb + j) * bb + i * 4;
          if (qtype == kQ8_0) {
            for (int t = 0; t < 8; ++t) std::memcpy(out + t * 32, blk + 2 + 4 * t, 4);
            continue;
          }
          uint16_t mh;
          if (qtype == kQ4_1) {
            mh = load_u16(blk + 2);
          } else {
            f32_to_f16_exact(-8.0f * f16_to_f32(load_u16(blk)), &mh);
          }
          store_u16(mm + gi * nb * 16 + (j * kRows + i) * 2, mh);
          // element e in the low nibble of qs[e], e + 16 in its high one: quarter t reads qs + 8 (t % 2), shifted
          const uint8_t* qs = blk + (qtype == kQ4_1 ? 4 : 2);
          for (int t = 0; t < 4; ++t) {
            const uint8_t* src = qs + 8 * (t % 2);
            const int shift = 4 * (t / 2);
            store_u32(out + t * 32, nibbles4(src, shift) | nibbles4(src + 4, shift) << 4);
          }
        }
      }
    }
  });
  return true;
}

bool repack_kquant_m16(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d, at::Tensor& m) {
  constexpr int64_t kQ4K = 12, kQ6K = 14;
  TORCH_CHECK(qtype == kQ4K || qtype == kQ6K, "repack_kquant_m16: ggml type ", qtype, " is not Q4_K or Q6_K");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "repack_kquant_m16: raw "
              "must be contiguous uint8 [rows, row bytes]");
  const bool q4k = qtype == kQ4K;
  const int64_t n = raw.size(0), row_bytes = raw.size(1), block = q4k ? 144 : 210;
  TORCH_CHECK(n % kRows == 0 && row_bytes % block == 0, "repack_kquant_m16: ", n, " rows of ", row_bytes,
              " bytes are not whole 8-row groups of whole blocks");
  const int64_t g = n / kRows, nj = row_bytes / block;
  for (const at::Tensor* t : {&data, &d, &m}) {
    const int64_t cols = t == &data ? nj * 8 * 256 : nj * 160;
    TORCH_CHECK(t->scalar_type() == at::kByte && t->is_contiguous() && t->dim() == 2 && t->size(0) == g &&
                t->size(1) == cols, "repack_kquant_m16: outputs must be contiguous uint8 [", g, ", ", cols, "]");
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  if (!finite_scales(src, n, row_bytes, q4k)) return false;
  uint8_t *dst = data.data_ptr<uint8_t>(), *dd = d.data_ptr<uint8_t>(), *mm = m.data_ptr<uint8_t>();
  parallel_for(0, g, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t gi = lo; gi < hi; ++gi) {
      repack_m16_group(src + gi * kRows * row_bytes, q4k, row_bytes, nj, dst + gi * nj * 8 * 256, dd + gi * nj * 160,
                       mm + gi * nj * 160);
    }
  });
  return true;
}

bool repack_kquant(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d,
                   const c10::optional<at::Tensor>& m) {
  constexpr int64_t kQ4K = 12, kQ6K = 14;  // ggml type ids
  TORCH_CHECK(qtype == kQ4K || qtype == kQ6K, "repack_kquant: ggml type ", qtype, " is not Q4_K (12) or Q6_K (14)");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "repack_kquant: raw must be "
              "contiguous uint8 [rows, row bytes]");
  const int64_t n = raw.size(0), row_bytes = raw.size(1), block = qtype == kQ4K ? 144 : 210;
  TORCH_CHECK(n % kRows == 0 && row_bytes % block == 0, "repack_kquant: ", n, " rows of ", row_bytes,
              " bytes are not whole 8-row groups of whole blocks");
  const int64_t g = n / kRows, nj = row_bytes / block, nb = nj * 8;
  const int64_t rec = qtype == kQ4K ? 96 : 160, bb = qtype == kQ4K ? 128 : 192;
  auto check_out = [&](const at::Tensor& t, int64_t cols, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 2 && t.size(0) == g &&
                t.size(1) == cols, "repack_kquant: ", what, " must be contiguous uint8 [", g, ", ", cols, "]");
  };
  check_out(data, nb * bb, "data");
  check_out(d, nj * rec, "d");
  TORCH_CHECK(m.has_value() == (qtype == kQ4K), "repack_kquant: Q4_K has mins, Q6_K none");
  if (m.has_value()) check_out(*m, nj * rec, "m");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  // every float16 super-scale finite, or the caller's general path decides
  if (!finite_scales(src, n, row_bytes, qtype == kQ4K)) return false;
  uint8_t *dst = data.data_ptr<uint8_t>(), *dd = d.data_ptr<uint8_t>();
  uint8_t* mm = m.has_value() ? m->data_ptr<uint8_t>() : nullptr;
  parallel_for(0, g, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t gi = lo; gi < hi; ++gi) {
      const uint8_t* rows = src + gi * kRows * row_bytes;
      if (qtype == kQ4K) {
        repack_q4_k_group(rows, row_bytes, nj, dst + gi * nb * bb, dd + gi * nj * rec, mm + gi * nj * rec);
      } else {
        repack_q6_k_group(rows, row_bytes, nj, dst + gi * nb * bb, dd + gi * nj * rec);
      }
    }
  });
  return true;
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("repack_kquant", &radixserve::repack_kquant);
  m.impl("repack_kquant_m16", &radixserve::repack_kquant_m16);
  m.impl("repack_legacy", &radixserve::repack_legacy);
}
