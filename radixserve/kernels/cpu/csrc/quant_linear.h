// Low-bit weight x int8 activation matrix-vector products for the few rows of a decode step, shared
// by the quant_linear op (quant_linear.cpp) and the fused decode stack (decode_stack.cpp).
//
// Weights come in blocks of 32 along K (b = k / 32), in one of seven kinds (layers/quantization/qweight.py:
// KINDS, the same ids; gguf_formats.py maps every exact GGUF type onto one of them):
//   Q8_0    w = d * q,      q int8,   d per 32
//   Q4_1    w = d * q + m,  q 0..15,  d, m per 32
//   Q8_M    w = d * q + m,  q int8,   d, m per 32
//   Q8_16   w = d * q,      q int8,   d per 16 (two scales per block)
//   Q8_M16  w = d * q + m,  q int8,   d, m per 16
//   Q5      w = d * q + m,  q 0..31,  d, m per 32 (Q4_1's nibbles plus a plane of fifth bits)
//   Q6      w = d * q,      q -32..31, d per 16 (Q6_K's values: the nibbles of q + 32 plus two bit planes)
// and are stored with 8 output rows interleaved (rows padded with zeros to a multiple of 8; G groups):
//   8-bit data int8 [G, nb * 256]: group g, block b, quarter t < 8, row i < 8, byte c < 4 = element 4t + c
//   Q4_1  data uint8 [G, nb * 128]: group g, block b, quarter t < 4, row i < 8, byte c < 4 holds element
//         8t + c (low nibble) and element 8t + 4 + c (high nibble)
//   Q5    data uint8 [G, nb * 160]: per block the 128 bytes of Q4_1's layout (the low 4 bits), then 32
//         bytes of fifth bits, row i < 8, byte c < 4: bit 2t = element 8t + c, bit 2t + 1 = element
//         8t + 4 + c. A nibble byte's fifth bits sit in the same lane of one 32-byte load: two shifts
//         and masks per quarter turn them into bit 4 of the unpacked bytes.
//   Q6    data uint8 [G, nb * 192]: per block Q4_1's 128 bytes holding the low 4 bits of q + 32, then two
//         32-byte planes p < 2 of top bits, row i < 8, byte c < 4: bits 4 (t - 2p) + 2h and the next are
//         bits 4-5 of element 8t + 4h + c (t = 2p, 2p + 1). Unpacked and less 32, a quarter's nibble
//         halves are the 8-bit layout's quarters 2t and 2t + 1, byte for byte, so Q6 forms Q8_16's sums.
//   d, m  float32 [G, nb * S * 8]: group g, block b, scale group s < S (S = 32 / group), row i,
//         or the same in **float16** (where every scale is a float16 value: the file's, for the legacy types)
//         or, **factored** (a uint8 tensor; K a multiple of 256): the K-quants' two-level scales as the
//         file holds them, per group and 256-element super-block j one record of 32 + 64 S bytes: the 8
//         rows' float32 super-scales, then int8 sub-scales (block b < 8 of j, scale group s, row i). The
//         kernel's scale is super * sub, the same float32 the flat layout stores (gguf_formats.py
//         factors a type only where the product is exact), at a quarter of the bytes: Q4_K's blocks
//         stream 4.75 bits a weight instead of 6.
// so one 32-byte load holds 4 (8-bit) or 8 (Q4_1) elements of 8 rows, the 4 activation bytes they
// meet are one broadcast, and the 8 rows' scales are one vector load: a group's 8 dot products run
// side by side in the lanes of one register and are stored without any horizontal reduction.
// layers/quantization/qweight.py builds this layout (and is the reference of what it means).
//
// The activations are quantised per row in the same 32-blocks (Q8ActRows), for every kind: int8 q, the
// scale d, and the min terms' sums s = d * sum(q) per 32 and s16 = d * sum(q) per 16.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace radixserve {

constexpr int64_t kQBlock = 32;
constexpr int64_t kQRows = 8;  // rows interleaved per group

enum class QKind : int64_t { Q8_0 = 0, Q4_1 = 1, Q8_M = 2, Q8_16 = 3, Q8_M16 = 4, Q5 = 5, Q6 = 6 };
constexpr int64_t kNumQKinds = 7;

struct QKindInfo {
  const char* name;
  int64_t scales_per_block;  // 1 (per 32) or 2 (per 16)
  bool has_min;
  int64_t bits;  // 4 / 5: unsigned values, low nibbles two per byte (Q4_1, Q5); 6: Q6; 8: one int8 per byte
  int64_t block_bytes() const { return kQRows * kQBlock * bits / 8; }  // data of one 8-row 32-block
};

// The kind's shape; nullptr for an id that is no kind.
const QKindInfo* qkind_info(int64_t kind);

// How a QMat's scales (and mins) are stored: flat float32, the factored records, or flat float16 (the file's own
// float16 scales, for the formats that have them: Q4_0 / Q4_1 / Q5_x / Q8_0 stream 2 bytes a scale, not 4).
constexpr int kScalesFlat = 0, kScalesFactored = 1, kScalesHalf = 2;

struct QMat {
  QKind kind = QKind::Q8_0;
  const void* data = nullptr;
  const void* d = nullptr;  // float32 or float16 scales, or factored records (uint8): `scales`
  const void* m = nullptr;  // kinds with a min only, laid out as d
  int scales = kScalesFlat;
  int64_t N = 0, K = 0, G = 0;
};

// Bytes of one factored scale record (a group's 256-element super-block) for S scale groups per block.
constexpr int64_t factored_record_bytes(int64_t S) { return 4 * kQRows + 8 * S * kQRows; }

// Validates the tensors (shapes, dtypes, contiguity) against N x K and views them as a QMat;
// `m` is ignored for a kind without mins. Scales of dtype uint8 are factored records (above), float16 flat halves. With
// `experts` > 1 the tensors hold that many such matrices back to back (a MoE projection's stacked experts)
// and the QMat views the first.
QMat qmat_from_tensors(int64_t kind, int64_t N, int64_t K, const at::Tensor& data, const at::Tensor& d,
                       const at::Tensor& m, const char* what, int64_t experts = 1);

struct Q8ActRows {
  std::vector<int8_t> q;
  // q + 128 as unsigned bytes, filled by the avx512vnni build only: there vpdpbusd's unsigned side is the
  // activations for the kinds with signed weights (quant_linear.cpp: signed_quarters2)
  std::vector<uint8_t> qu;
  std::vector<float> d, s, s16;  // s16: [M, nb * 2]
  int64_t M = 0, K = 0;
};

// Quantise x [M, K] (row stride ldx floats) into `a` (buffers reused across calls).
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int64_t ldx, Q8ActRows& a);

// out [M, N] (row stride ldo) = dequant(W) . x^T (+ bias[N] when not null), parallel over row groups.
void qgemm(const QMat& w, const Q8ActRows& a, const float* bias, float* out, int64_t ldo);

// The same products for weight groups g0 .. g1 (output rows 8 * g0 ..) and activation rows r0 .. r1 only,
// on the calling thread (a caller that splits work its own way: fused_experts.cpp's (expert, row block)
// items). Each row's arithmetic is qgemm's, so a row's result does not depend on how the work was split.
void qgemm_range(const QMat& w, const Q8ActRows& a, float* out, int64_t ldo, int64_t g0, int64_t g1, int64_t r0,
                 int64_t r1);

}  // namespace radixserve
