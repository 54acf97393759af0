// Flash attention on CPU for long query blocks (PREFILL, EXTEND chunks, MIXED's prefill part): tiled,
// with an online softmax, reading K/V in place from the paged pool (float32 or bfloat16) through the
// slot table. Op schema: ops.cpp; built per CPU ISA by radixserve/kernels/cpu/loader.py.
//
// Why: scaled_dot_product_attention needs an explicit [ext, seq] mask as soon as a request has a cached
// prefix (EXTEND, every chunk after the first of a chunked prefill), and with a mask it takes a path
// about half as fast as its causal one, after a gathered copy of the whole history per layer. Here
// every mode is one rule (query i of a request sits at position seq_len - ext + i and sees keys 0 ..
// that position, or the last `window` of them; scores soft-capped when softcap > 0: attn_common.h),
// nothing S x S is ever materialised, and the two products are register-blocked GEMM
// tiles, so the cost per (query, key) pair stays flat as the prompt grows.
//
//   q        [n, H, D]      float32; request b owns rows q_start[b] .. q_start[b] + q_lens[b] - 1
//   k, v     [S, Hkv, D]    one layer of the KV pool (this step's K/V already written)
//   kv_idx   [nb, max_len]  int64 slot table;  seq_lens, q_start, q_lens [nb] int64
//   out      [n, H, D]      float32
//   q_last   [n] int64, optional: the last key position each query row sees, when that is past its own
//            position (a run of image tokens that attend to each other both ways: Gemma 3); absent, every
//            row's is its position. Non-decreasing within a request, and < its seq_len (checked).
//
// Work item = (request, kv head, block of kQBlock queries). The G = H / Hkv query heads that share a
// kv head go together: a block is R = queries x G rows against the same keys, so each K/V tile is
// gathered (and widened, for bf16) once for all of them. Per key tile of kKBlock keys:
//   Kt [D][kKBlock] = the tile's keys, transposed;  S = Q . Kt (4 rows x 16 keys in registers)
//   online softmax per row (running max m, sum l; O rescaled when m grows)
//   O += P . V (4 rows x 16 dims in registers), V [kKBlock][D] gathered
// With a window, a block's key tiles start at its first row's first visible key, so tiles outside
// every row's window are never gathered and a local layer's cost per query stays O(window).
// Items are taken longest first from a shared counter: causal blocks differ in cost up to their
// request's length, so a static split would leave one thread with the late (long) blocks.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attn_common.h"
#include "bf16.h"
#include "kv_quant.h"
#include "ops.h"

namespace radixserve {
namespace {

constexpr int64_t kQBlock = 32;  // queries per work item (x G rows)
constexpr int64_t kKBlock = 64;  // keys per tile
// the running max before any key: finite, as -ffast-math assumes no infinities (exp of it - m is 0)
constexpr float kNoMax = -1e30f;

struct Item {
  int64_t b, h, i0, i1, cost;
};

struct Scratch {
  std::vector<float> kt, vt, s, o, m, l;
};

template <typename P>
void gather_tiles(P kp, P vp, const int64_t* idx, int64_t t0, int64_t nk, int64_t row, int64_t off,
                  int64_t D, float* kt, float* vt) {
  // kt [D][kKBlock] (transposed keys), vt [kKBlock][D]; keys past nk are zero
  for (int64_t j = 0; j < nk; ++j) {
    const P kr = kp + idx[t0 + j] * row + off;
    const P vr = vp + idx[t0 + j] * row + off;
    for (int64_t d = 0; d < D; ++d) {
      kt[d * kKBlock + j] = to_f32(kr[d]);
      vt[j * D + d] = to_f32(vr[d]);
    }
  }
  for (int64_t j = nk; j < kKBlock; ++j) {
    for (int64_t d = 0; d < D; ++d) kt[d * kKBlock + j] = 0.f;
    for (int64_t d = 0; d < D; ++d) vt[j * D + d] = 0.f;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The register tiles below are written once over a vector type: 8 lanes (ymm) on AVX2, 16 (zmm) on the AVX-512
// variants. Each output element is the same FMA chain over d (scores) or j (P.V) in order whatever the width, so
// every variant computes the same bits; a zmm tile does twice the multiply-adds an instruction.
struct Ymm {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
};
#if defined(__AVX512F__)
struct Zmm {
  using V = __m512;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
};
using Wide = Zmm;
#else
using Wide = Ymm;
#endif
static_assert(kKBlock % (2 * Wide::W) == 0, "a score tile covers 2 vectors of keys at a time");

// s [4][kKBlock] = scale * q[0..4) . kt: 4 rows x 2 vectors of keys in eight accumulators, one broadcast of a query
// element serving 2 W keys
template <class T>
inline void scores_4rows(const float* const* q, const float* kt, int64_t D, float scale, float* s) {
  const typename T::V sc = T::set1(scale);
  for (int64_t j = 0; j < kKBlock; j += 2 * T::W) {
    typename T::V a[4][2];
    for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = T::zero();
    for (int64_t d = 0; d < D; ++d) {
      const typename T::V k0 = T::load(kt + d * kKBlock + j), k1 = T::load(kt + d * kKBlock + j + T::W);
      for (int i = 0; i < 4; ++i) {
        const typename T::V x = T::set1(q[i][d]);
        a[i][0] = T::fma(x, k0, a[i][0]), a[i][1] = T::fma(x, k1, a[i][1]);
      }
    }
    for (int i = 0; i < 4; ++i)
      T::store(s + i * kKBlock + j, T::mul(a[i][0], sc)), T::store(s + i * kKBlock + j + T::W, T::mul(a[i][1], sc));
  }
}

// o [4][D] += p [4][kKBlock] . vt [kKBlock][D] over the first nk keys: 4 rows x 2 vectors of dims in registers
template <class T>
inline void pv_4rows(const float* p, const float* vt, int64_t nk, int64_t D, float* o) {
  for (int64_t d = 0; d < D; d += 2 * T::W) {
    typename T::V a[4][2];
    for (int i = 0; i < 4; ++i) a[i][0] = T::load(o + i * D + d), a[i][1] = T::load(o + i * D + d + T::W);
    for (int64_t j = 0; j < nk; ++j) {
      const typename T::V v0 = T::load(vt + j * D + d), v1 = T::load(vt + j * D + d + T::W);
      for (int i = 0; i < 4; ++i) {
        const typename T::V x = T::set1(p[i * kKBlock + j]);
        a[i][0] = T::fma(x, v0, a[i][0]), a[i][1] = T::fma(x, v1, a[i][1]);
      }
    }
    for (int i = 0; i < 4; ++i) T::store(o + i * D + d, a[i][0]), T::store(o + i * D + d + T::W, a[i][1]);
  }
}
#endif

// s [R][kKBlock] = scale * q_rows . kt, rows r = (i - i0) * G + g read from q (row stride D within a head)
void scores_tile(const float* const* qrows, int64_t R, const float* kt, int64_t D, float scale, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) scores_4rows<Wide>(qrows + r, kt, D, scale, s + r * kKBlock);
  const __m256 sc = _mm256_set1_ps(scale);
  for (; r < R; ++r) {
    for (int64_t j = 0; j < kKBlock; j += 8) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) a = _mm256_fmadd_ps(_mm256_broadcast_ss(qrows[r] + d), _mm256_loadu_ps(kt + d * kKBlock + j), a);
      _mm256_storeu_ps(s + r * kKBlock + j, _mm256_mul_ps(a, sc));
    }
  }
#else
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < kKBlock; ++j) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += qrows[r][d] * kt[d * kKBlock + j];
      s[r * kKBlock + j] = a * scale;
    }
#endif
}

// o [R][D] += p [R][kKBlock] . vt [kKBlock][D] over the first nk keys
void pv_tile(const float* p, int64_t R, const float* vt, int64_t nk, int64_t D, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
      if (D % (2 * Wide::W) == 0) {
        pv_4rows<Wide>(p + r * kKBlock, vt, nk, D, o + r * D);
      } else {
        pv_4rows<Ymm>(p + r * kKBlock, vt, nk, D, o + r * D);
      }
    }
    for (; r < R; ++r) {
      for (int64_t d = 0; d < D; d += 8) {
        __m256 a = _mm256_loadu_ps(o + r * D + d);
        for (int64_t j = 0; j < nk; ++j)
          a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * kKBlock + j), _mm256_loadu_ps(vt + j * D + d), a);
        _mm256_storeu_ps(o + r * D + d, a);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < nk; ++j) {
      const float w = p[r * kKBlock + j];
      for (int64_t d = 0; d < D; ++d) o[r * D + d] += w * vt[j * D + d];
    }
}

// The keys of the block's rows i0 .. i1 - 1 (positions pos0 + i): first .. last - 1 is the union of
// their visible ranges, contiguous because consecutive positions' windows overlap.
struct BlockKeys {
  int64_t first, last;
};
inline BlockKeys block_keys(int64_t pos0, int64_t i0, int64_t i1, int64_t window, const int64_t* last) {
  return {window_start(pos0 + i0, window), last != nullptr ? last[i1 - 1] + 1 : pos0 + i1};
}

template <typename P>
void run_item(const Item& it, const float* qp, P kp, P vp, const int64_t* idx, int64_t seq_len,
              int64_t q_len, int64_t q_row0, int64_t H, int64_t G, int64_t D, int64_t row, float scale,
              int64_t window, float softcap, const int64_t* last, float* op, Scratch& w) {
  const int64_t nq = it.i1 - it.i0, R = nq * G, pos0 = seq_len - q_len;
  const BlockKeys keys = block_keys(pos0, it.i0, it.i1, window, last);
  w.kt.resize(D * kKBlock), w.vt.resize(kKBlock * D), w.s.resize(R * kKBlock), w.o.assign(R * D, 0.f);
  w.m.assign(R, kNoMax), w.l.assign(R, 0.f);
  std::vector<const float*> qrows(R);
  for (int64_t r = 0; r < R; ++r) qrows[r] = qp + ((q_row0 + it.i0 + r / G) * H + it.h * G + r % G) * D;
  for (int64_t t0 = keys.first; t0 < keys.last; t0 += kKBlock) {
    const int64_t nk = std::min(kKBlock, keys.last - t0);
    gather_tiles(kp, vp, idx, t0, nk, row, it.h * D, D, w.kt.data(), w.vt.data());
    scores_tile(qrows.data(), R, w.kt.data(), D, scale, w.s.data());
    for (int64_t r = 0; r < R; ++r) {
      float* s = w.s.data() + r * kKBlock;
      // row r is query i = i0 + r / G at position pos: it sees tile columns j0 .. j1 - 1 (keys t0 + j
      // in window_start(pos) .. pos, or .. q_last[i])
      const int64_t pos = pos0 + it.i0 + r / G, upto = last != nullptr ? last[it.i0 + r / G] : pos;
      const int64_t j0 = std::max<int64_t>(0, window_start(pos, window) - t0), j1 = std::min(nk, upto + 1 - t0);
      if (j1 <= j0) {  // a whole tile outside this row's keys (past its position, or before its window)
        for (int64_t j = 0; j < kKBlock; ++j) s[j] = 0.f;
        continue;
      }
      if (softcap > 0.f) soft_cap(s + j0, j1 - j0, softcap);
      float mx = w.m[r];
      for (int64_t j = j0; j < j1; ++j) mx = s[j] > mx ? s[j] : mx;
      const float alpha = std::exp(w.m[r] - mx);
      float sum = 0.f;
      for (int64_t j = j0; j < j1; ++j) s[j] = std::exp(s[j] - mx);
      for (int64_t j = 0; j < j0; ++j) s[j] = 0.f;
      for (int64_t j = j1; j < kKBlock; ++j) s[j] = 0.f;
      for (int64_t j = j0; j < j1; ++j) sum += s[j];
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = mx;
      if (alpha != 1.f) {
        float* o = w.o.data() + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      }
    }
    pv_tile(w.s.data(), R, w.vt.data(), nk, D, w.o.data());
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / w.l[r];
    float* orow = op + ((q_row0 + it.i0 + r / G) * H + it.h * G + r % G) * D;
    const float* o = w.o.data() + r * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = o[d] * inv;
  }
}

}  // namespace

void extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                      const at::Tensor& seq_lens, const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
                      int64_t window, double softcap, at::Tensor& out, const c10::optional<at::Tensor>& q_last) {
  check_varlen_attention("extend_attention", q, k, v, kv_idx, seq_lens, q_start, q_lens, out, window, softcap);
  const int64_t nb = kv_idx.size(0), max_len = kv_idx.size(1);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(D % 8 == 0, "extend_attention: head size ", D, " is not a multiple of 8");
  const int64_t G = H / Hkv;
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* sp = q_start.data_ptr<int64_t>();
  const int64_t* np = q_lens.data_ptr<int64_t>();
  const int64_t* lastp = nullptr;
  if (q_last.has_value()) {
    const at::Tensor& t = *q_last;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.size(0) == q.size(0),
                "extend_attention: q_last must be contiguous int64 [", q.size(0), "]");
    lastp = t.data_ptr<int64_t>();
    for (int64_t b = 0; b < nb; ++b) {  // a row sees at least itself, keys that exist, in order
      for (int64_t i = 0; i < np[b]; ++i) {
        const int64_t pos = lp[b] - np[b] + i, x = lastp[sp[b] + i];
        TORCH_CHECK(x >= pos && x < lp[b] && (i == 0 || x >= lastp[sp[b] + i - 1]), "extend_attention: q_last of "
                    "row ", sp[b] + i, " is ", x, ", not in [its position ", pos, ", seq_len ", lp[b], ") or "
                    "decreasing");
      }
    }
  }
  std::vector<Item> items;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i0 = 0; i0 < np[b]; i0 += kQBlock) {
      const int64_t i1 = std::min(i0 + kQBlock, np[b]);
      const BlockKeys keys = block_keys(lp[b] - np[b], i0, i1, window, lastp == nullptr ? nullptr : lastp + sp[b]);
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({b, h, i0, i1, (i1 - i0) * (keys.last - keys.first)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& c) { return a.cost > c.cost; });
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = Hkv * D;
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  auto work = [&](auto kp, auto vp) {
    parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch w;
      for (int64_t j = next.fetch_add(1); j < total; j = next.fetch_add(1)) {
        const Item& it = items[j];
        run_item(it, qp, kp, vp, ip + it.b * max_len, lp[it.b], np[it.b], sp[it.b], H, G, D, row, fscale, window,
                 fcap, lastp == nullptr ? nullptr : lastp + sp[it.b], op, w);
      }
    });
  };
  if (with_quantised_kv(k, v, work)) {  // q8_0 blocks or fp8 rows (kv_quant.h)
    return;
  } else if (k.scalar_type() == at::kBFloat16) {
    work(reinterpret_cast<const bf16_t*>(k.data_ptr()), reinterpret_cast<const bf16_t*>(v.data_ptr()));
  } else {
    work(k.data_ptr<float>(), v.data_ptr<float>());
  }
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("extend_attention", &radixserve::extend_attention); }
