// lora_sgmv: the LoRA deltas of one projection for every row of a step, each row with its own adapter
// (Punica's "segmented gather matrix-vector", SGMV, on the CPU):
//
//   out[i] += B_g . (A_g . x[i])   for every row i whose adapter is g (row_group[i] = g; -1 = base row)
//
// The step's adapters lie side by side (lora/lora_dense.py): A [ranks, in], Bt = B^T [ranks, out], adapter g owning
// some rank columns (scaling folded into B). blocks [S, 5] = (g, o0, on, r0, rn): output rows [o0, o0 + on)
// of adapter g use its ranks [r0, r0 + rn): one block per shard of a stacked projection (qkv, gate_up),
// whose B is block diagonal, so only those ranks are read and multiplied and the zeros never touched. Each adapter's
// weights are read once per step however many rows use it, and no row pays for another adapter's ranks (the dense
// side-by-side form did: every row against every adapter, 8x the work at 8 adapters).
//
// A and Bt are float32 or bfloat16 (both the same): bf16 where the adapters are held in bf16 (--dtype auto on a
// CPU with native bf16), which halves the bytes a step streams; a bf16 widens to float32 exactly, so the
// products are those of a float32 copy of the same weights, bit for bit. x and out are float32.
//
// Two parallel regions per call: t = A . x over (adapter, rank) items, then the deltas over chunks of output
// rows (axpys along B's transposed rows). Rows of one adapter go through both in tiles of up to kTile rows that
// share each weight load and its widening; every row's sums run in the same order whatever its tile (no
// dependence on the batch), so a row's delta is the same alone or batched.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "ops.h"

namespace radixserve {
namespace {

// Sixteen-lane vectors written out (GCC vector extensions, unaligned loads, a zero-padded tail), so the
// summation order is fixed by this code: with -ffast-math the compiler would otherwise vectorise a plain
// loop with a peel that depends on the pointers' alignment, and the same row would round differently
// alone and batched. A v16f is one zmm register on the AVX-512 variants and two ymm on AVX2, with the same
// lanes either way: every ISA variant computes the same bits (lane l of a dot product's accumulator sums
// elements j + l, and each output of an axpy sums its ranks in order).
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

constexpr int kTile = 4;  // rows of one adapter per weight load
// outputs a row keeps in registers in add_ranks: two v16f a row on AVX-512 (8 zmm accumulators for a 4-row tile:
// enough independent FMA chains to cover the latency), one on AVX2, whose 16 ymm registers hold 4 rows x 2 halves
// and rank columns of A per work item in dots: 4 on AVX-512 (16 zmm accumulators for a 4-row tile, each x load
// serving 4 columns: the loop was bound by loads with one), 2 on AVX2 (8 accumulators of two ymm each)
#if defined(__AVX512F__)
constexpr int kOutVecs = 2;
constexpr int kCols = 4;
#else
constexpr int kOutVecs = 1;
constexpr int kCols = 2;
#endif

inline v16f vload(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f vload(const bf16_t* p) {  // exact: a bf16 is the upper half of its float32
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 lo = load8(p), hi = load8(p + 8);  // bf16.h: one zero-extension and one shift per half
  v16f v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

inline void vstore(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

inline v16f splat(float a) { return v16f{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

// res[q * N + r] = a + q * in . xs[r] for C rank columns (rows of A) and N rows, each sum in one fixed order (a
// 16-lane accumulator, a zero-padded tail, the same pairwise reduction) that depends on neither C nor N: each x
// load serves C columns and each A load N rows (C x N accumulators in registers)
template <typename W, int C, int N>
inline void dots(const W* a, int64_t in, const float* const* xs, float* res) {
  v16f acc[C][N];
  for (int q = 0; q < C; ++q)
    for (int r = 0; r < N; ++r) acc[q][r] = splat(0.f);
  int64_t j = 0;
  for (; j + 16 <= in; j += 16) {
    v16f av[C];
    for (int q = 0; q < C; ++q) av[q] = vload(a + q * in + j);
    for (int r = 0; r < N; ++r) {
      const v16f xv = vload(xs[r] + j);
      for (int q = 0; q < C; ++q) acc[q][r] += av[q] * xv;
    }
  }
  if (j < in) {  // the last < 16 elements, zero-padded; fewer than 8 go to the upper lanes (the lanes of the
                 // ymm code before this one, whose bits these are)
    const int64_t off = in - j >= 8 ? 0 : 8;
    for (int q = 0; q < C; ++q) {
      float ta[16] = {0.f};
      for (int64_t k = j; k < in; ++k) ta[off + k - j] = to_f32(a[q * in + k]);
      const v16f av = vload(ta);
      for (int r = 0; r < N; ++r) {
        float tb[16] = {0.f};
        std::memcpy(tb + off, xs[r] + j, sizeof(float) * (in - j));
        acc[q][r] += av * vload(tb);
      }
    }
  }
  for (int q = 0; q < C; ++q)
    for (int r = 0; r < N; ++r) {  // the halves added as one 8-lane vector, then pairwise: written as vector
                                    // ops, since scalar lane sums let -ffast-math re-associate them per C and N
      v8f lo, hi;
      std::memcpy(&lo, &acc[q][r], sizeof(lo));
      std::memcpy(&hi, reinterpret_cast<const char*>(&acc[q][r]) + sizeof(lo), sizeof(hi));
      const v8f s = lo + hi;
      res[q * N + r] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
}

// ys[r][o0 .. o0 + 16V) += sum over k in [0, cn) of tt[k * N + r] * bt[(c0 + k) * ld + o], k in order, for N rows:
// V vectors of 16 outputs of each row held in registers across the ranks, each Bt chunk loaded once for the N rows.
// tt holds the tile's ranks interleaved (rank-major), so the inner loop walks two pointers (with the rows' own
// rank pointers GCC kept its counters on the stack); rank by rank over whole Bt rows, with the outputs loaded and
// stored per rank, measured 1.5-3x slower.
template <typename W, int N, int V>
inline void add_block(float* const* ys, const W* bt, int64_t ld, const float* tt, int64_t c0, int64_t cn, int64_t o) {
  v16f y[N][V];
  for (int r = 0; r < N; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = vload(ys[r] + o + 16 * v);
  const W* row = bt + c0 * ld + o;
  const float* tp = tt;
  for (int64_t k = 0; k < cn; ++k, row += ld, tp += N) {
    v16f b[V];
    for (int v = 0; v < V; ++v) b[v] = vload(row + 16 * v);
    for (int r = 0; r < N; ++r) {
      const v16f av = splat(tp[r]);
      for (int v = 0; v < V; ++v) y[r][v] += av * b[v];
    }
  }
  for (int r = 0; r < N; ++r)
    for (int v = 0; v < V; ++v) vstore(ys[r] + o + 16 * v, y[r][v]);
}

// the outputs [lo, hi) of N rows: blocks of 16 kOutVecs outputs, then of 16, then the last < 16 outputs by the same
// steps on zero-padded copies (a scalar loop would be vectorised by the compiler in an order of its own, one per
// weight type). Each output's sum is the same whatever block it falls in.
template <typename W, int N>
inline void add_ranks(float* const* ys, const W* bt, int64_t ld, const float* tt, int64_t c0, int64_t cn,
                      int64_t lo, int64_t hi) {
  int64_t o = lo;
  for (; o + 16 * kOutVecs <= hi; o += 16 * kOutVecs) add_block<W, N, kOutVecs>(ys, bt, ld, tt, c0, cn, o);
  for (; o + 16 <= hi; o += 16) add_block<W, N, 1>(ys, bt, ld, tt, c0, cn, o);
  if (o < hi) {
    const int64_t w = hi - o;
    float yb[N][16];
    v16f y[N];
    for (int r = 0; r < N; ++r) {
      std::memset(yb[r], 0, sizeof(yb[r]));
      std::memcpy(yb[r], ys[r] + o, sizeof(float) * w);
      y[r] = vload(yb[r]);
    }
    for (int64_t k = 0; k < cn; ++k) {
      float bb[16] = {0.f};
      for (int64_t j = 0; j < w; ++j) bb[j] = to_f32(bt[(c0 + k) * ld + o + j]);
      const v16f b = vload(bb);
      for (int r = 0; r < N; ++r) y[r] += splat(tt[k * N + r]) * b;
    }
    for (int r = 0; r < N; ++r) {
      vstore(yb[r], y[r]);
      std::memcpy(ys[r] + o, yb[r], sizeof(float) * w);
    }
  }
}

// f(p, n) over the rows of one adapter in tiles: f<kTile> on full tiles, then one call for the rest
template <typename F>
inline void over_tiles(const std::vector<int64_t>& rs, F&& f) {
  const int64_t n = static_cast<int64_t>(rs.size());
  int64_t k = 0;
  for (; k + kTile <= n; k += kTile) f(rs.data() + k, std::integral_constant<int, kTile>());
  switch (n - k) {
    case 3: f(rs.data() + k, std::integral_constant<int, 3>()); break;
    case 2: f(rs.data() + k, std::integral_constant<int, 2>()); break;
    case 1: f(rs.data() + k, std::integral_constant<int, 1>()); break;
    default: break;
  }
}

// f(integral_constant<int, n>) for a work item's n in [1, kCols] rank columns
template <typename F>
inline void with_cols(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
#if defined(__AVX512F__)
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
#endif
    default: break;
  }
  static_assert(kCols <= 4, "with_cols dispatches up to 4 columns");
}

template <typename W>
void sgmv(const at::Tensor& x, const int64_t* bl, int64_t S, const std::vector<std::vector<int64_t>>& rows,
          const std::vector<int64_t>& item_g, const std::vector<int64_t>& item_c, const std::vector<int>& item_n,
          int64_t R, const W* ap,
          const W* btp, at::Tensor& out) {
  const int64_t M = x.size(0), in = x.size(1), n_out = out.size(1), xs = x.stride(0);
  const int64_t n_items = static_cast<int64_t>(item_g.size());
  std::vector<float> t(static_cast<size_t>(M) * R);  // [M, R]: row i's ranks at t[i * R + c]
  const float* xp = x.data_ptr<float>();
  // t[i, c] = A[c] . x[i] for c in the row's adapter's columns: work items are (adapter, up to kCols rank
  // columns), each A row read once for all rows of its adapter
  parallel_for(0, n_items, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t c = item_c[it];
      over_tiles(rows[item_g[it]], [&](const int64_t* rp, auto tile) {
        constexpr int N = decltype(tile)::value;
        const float* xr[N];
        for (int r = 0; r < N; ++r) xr[r] = xp + rp[r] * xs;
        with_cols(item_n[it], [&](auto cols) {
          constexpr int C = decltype(cols)::value;
          float res[C * N];
          dots<W, C, N>(ap + c * in, in, xr, res);
          for (int q = 0; q < C; ++q)
            for (int r = 0; r < N; ++r) t[rp[r] * R + c + q] = res[q * N + r];
        });
      });
    }
  });
  // out[i, o0 : o1] += t[i, c] * Bt[c, o0 : o1] for the ranks c of the row's adapter's block that holds
  // [o0, o1): contiguous axpys over output rows (no horizontal sums), the chunk of Bt in cache for all rows of
  // its adapter; threads take disjoint output chunks, and each element's sum runs over c in order
  float* op = out.data_ptr<float>();
  parallel_for(0, n_out, 64, [&](int64_t o_lo, int64_t o_hi) {
    std::vector<float> tt;  // one tile's ranks, rank-major: tt[k * N + r] = t[row r, rank c0 + k]
    for (int64_t s = 0; s < S; ++s) {
      const int64_t* b = bl + 5 * s;
      const std::vector<int64_t>& rs = rows[b[0]];
      if (rs.empty() || b[4] == 0) continue;
      const int64_t lo = std::max(o_lo, b[1]), hi = std::min(o_hi, b[1] + b[2]);
      if (lo >= hi) continue;
      over_tiles(rs, [&](const int64_t* rp, auto tile) {
        constexpr int N = decltype(tile)::value;
        float* yr[N];
        tt.resize(static_cast<size_t>(b[4]) * N);
        for (int r = 0; r < N; ++r) {
          yr[r] = op + rp[r] * n_out;
          for (int64_t k = 0; k < b[4]; ++k) tt[k * N + r] = t[rp[r] * R + b[3] + k];
        }
        add_ranks<W, N>(yr, btp, n_out, tt.data(), b[3], b[4], lo, hi);
      });
    }
  });
}

}  // namespace

void lora_sgmv(const at::Tensor& x, const at::Tensor& row_group, const at::Tensor& A, const at::Tensor& Bt,
               const at::Tensor& blocks, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "lora_sgmv: x must be float32 [M, in]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0),
              "lora_sgmv: out must be float32 contiguous [M, out]");
  TORCH_CHECK(row_group.scalar_type() == at::kLong && row_group.is_contiguous() && row_group.numel() == x.size(0),
              "lora_sgmv: row_group must be int64 [M]");
  const int64_t M = x.size(0), in = x.size(1), n_out = out.size(1);
  const bool bf16 = A.scalar_type() == at::kBFloat16;
  TORCH_CHECK((A.scalar_type() == at::kFloat || bf16) && A.is_contiguous() && A.dim() == 2 && A.size(1) == in,
              "lora_sgmv: A must be float32 or bfloat16, contiguous [ranks, ", in, "]");
  const int64_t R = A.size(0);
  TORCH_CHECK(Bt.scalar_type() == A.scalar_type() && Bt.is_contiguous() && Bt.dim() == 2 && Bt.size(0) == R &&
                  Bt.size(1) == n_out, "lora_sgmv: Bt must be contiguous [", R, ", ", n_out,
              "] (B transposed), in A's dtype");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.dim() == 2 && blocks.size(1) == 5,
              "lora_sgmv: blocks must be int64 [S, 5] (adapter, out start, out rows, rank start, ranks)");
  const int64_t S = blocks.size(0);
  const int64_t* bl = blocks.data_ptr<int64_t>();
  int64_t G = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* b = bl + 5 * s;
    TORCH_CHECK(b[0] >= 0 && b[1] >= 0 && b[2] >= 0 && b[1] + b[2] <= n_out && b[3] >= 0 && b[4] >= 0 && b[3] + b[4] <= R,
                "lora_sgmv: block ", s, " lies outside A / B");
    G = std::max(G, b[0] + 1);
  }
  // each adapter's rank columns: the span of its blocks
  std::vector<int64_t> c0(G, R), c1(G, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* b = bl + 5 * s;
    if (b[4] == 0) continue;
    c0[b[0]] = std::min(c0[b[0]], b[3]), c1[b[0]] = std::max(c1[b[0]], b[3] + b[4]);
  }
  const int64_t* rg = row_group.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(G);
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(rg[i] >= -1, "lora_sgmv: row ", i, " has adapter ", rg[i]);
    if (rg[i] >= 0 && rg[i] < G && c1[rg[i]] > c0[rg[i]]) rows[rg[i]].push_back(i);  // else: no delta here
  }
  std::vector<int64_t> item_g, item_c;
  std::vector<int> item_n;
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g].empty()) continue;
    for (int64_t c = c0[g]; c < c1[g]; c += kCols)
      item_g.push_back(g), item_c.push_back(c), item_n.push_back(static_cast<int>(std::min<int64_t>(kCols, c1[g] - c)));
  }
  if (item_g.empty()) return;
  if (bf16) {
    sgmv<bf16_t>(x, bl, S, rows, item_g, item_c, item_n, R, reinterpret_cast<const bf16_t*>(A.data_ptr()),
                 reinterpret_cast<const bf16_t*>(Bt.data_ptr()), out);
  } else {
    sgmv<float>(x, bl, S, rows, item_g, item_c, item_n, R, A.data_ptr<float>(), Bt.data_ptr<float>(), out);
  }
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("lora_sgmv", &radixserve::lora_sgmv); }
