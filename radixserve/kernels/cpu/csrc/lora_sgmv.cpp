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

// Eight-lane vectors written out (GCC vector extensions, unaligned loads, a zero-padded tail), so the
// summation order is fixed by this code: with -ffast-math the compiler would otherwise vectorise a plain
// loop with a peel that depends on the pointers' alignment, and the same row would round differently
// alone and batched.
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int kTile = 4;  // rows of one adapter per weight load: 2 x kTile accumulators stay in registers

inline v8f vload(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v8f vload(const bf16_t* p) {  // exact: a bf16 is the upper half of its float32
#if defined(__AVX2__) && defined(__FMA__)
  return (v8f)load8(p);  // bf16.h: one zero-extension and one shift (GCC splits the generic form into six ops)
#else
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

inline void vstore(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }

// res[r] = a . xs[r] for N rows, each sum in one fixed order (two interleaved 8-lane accumulators, a
// zero-padded tail, the same pairwise reduction) that does not depend on N
template <typename W, int N>
inline void dots(const W* a, const float* const* xs, int64_t n, float* res) {
  v8f acc0[N], acc1[N];
  for (int r = 0; r < N; ++r) acc0[r] = acc1[r] = splat(0.f);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v8f a0 = vload(a + j), a1 = vload(a + j + 8);
    for (int r = 0; r < N; ++r) {
      acc0[r] += a0 * vload(xs[r] + j);
      acc1[r] += a1 * vload(xs[r] + j + 8);
    }
  }
  if (j + 8 <= n) {
    const v8f a0 = vload(a + j);
    for (int r = 0; r < N; ++r) acc0[r] += a0 * vload(xs[r] + j);
    j += 8;
  }
  if (j < n) {
    float ta[8] = {0.f};
    for (int64_t k = j; k < n; ++k) ta[k - j] = to_f32(a[k]);
    const v8f av = vload(ta);
    for (int r = 0; r < N; ++r) {
      float tb[8] = {0.f};
      std::memcpy(tb, xs[r] + j, sizeof(float) * (n - j));
      acc1[r] += av * vload(tb);
    }
  }
  for (int r = 0; r < N; ++r) {
    const v8f s = acc0[r] + acc1[r];
    res[r] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  }
}

// ys[r][o] += sum over k in [0, cn) of tt[k * N + r] * bt[(c0 + k) * ld + o], for o in [lo, hi), k in order, for
// N rows: 16 outputs of each row held in registers across the ranks, each Bt chunk loaded once for the N rows.
// tt holds the tile's ranks interleaved (rank-major), so the inner loop walks two pointers (with the rows' own
// rank pointers GCC kept its counters on the stack); rank by rank over whole Bt rows, with the outputs loaded and
// stored per rank, measured 1.5-3x slower.
template <typename W, int N>
inline void add_ranks(float* const* ys, const W* bt, int64_t ld, const float* tt, int64_t c0, int64_t cn,
                      int64_t lo, int64_t hi) {
  int64_t o = lo;
  for (; o + 16 <= hi; o += 16) {
    v8f y0[N], y1[N];
    for (int r = 0; r < N; ++r) y0[r] = vload(ys[r] + o), y1[r] = vload(ys[r] + o + 8);
    const W* row = bt + c0 * ld + o;
    const float* tp = tt;
    for (int64_t k = 0; k < cn; ++k, row += ld, tp += N) {
      const v8f b0 = vload(row), b1 = vload(row + 8);
      for (int r = 0; r < N; ++r) {
        const v8f av = splat(tp[r]);
        y0[r] += av * b0;
        y1[r] += av * b1;
      }
    }
    for (int r = 0; r < N; ++r) vstore(ys[r] + o, y0[r]), vstore(ys[r] + o + 8, y1[r]);
  }
  if (o < hi) {  // the last < 16 outputs: the same steps on zero-padded copies (a scalar loop would be
                 // vectorised by the compiler in an order of its own, one per weight type)
    const int64_t w = hi - o;
    float yb[N][16];
    v8f y0[N], y1[N];
    for (int r = 0; r < N; ++r) {
      std::memset(yb[r], 0, sizeof(yb[r]));
      std::memcpy(yb[r], ys[r] + o, sizeof(float) * w);
      y0[r] = vload(yb[r]), y1[r] = vload(yb[r] + 8);
    }
    for (int64_t k = 0; k < cn; ++k) {
      float bb[16] = {0.f};
      for (int64_t j = 0; j < w; ++j) bb[j] = to_f32(bt[(c0 + k) * ld + o + j]);
      const v8f b0 = vload(bb), b1 = vload(bb + 8);
      for (int r = 0; r < N; ++r) {
        const v8f av = splat(tt[k * N + r]);
        y0[r] += av * b0;
        y1[r] += av * b1;
      }
    }
    for (int r = 0; r < N; ++r) {
      vstore(yb[r], y0[r]), vstore(yb[r] + 8, y1[r]);
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

template <typename W>
void sgmv(const at::Tensor& x, const int64_t* bl, int64_t S, const std::vector<std::vector<int64_t>>& rows,
          const std::vector<int64_t>& item_g, const std::vector<int64_t>& item_c, int64_t R, const W* ap,
          const W* btp, at::Tensor& out) {
  const int64_t M = x.size(0), in = x.size(1), n_out = out.size(1), xs = x.stride(0);
  const int64_t n_items = static_cast<int64_t>(item_g.size());
  std::vector<float> t(static_cast<size_t>(M) * R);  // [M, R]: row i's ranks at t[i * R + c]
  const float* xp = x.data_ptr<float>();
  // t[i, c] = A[c] . x[i] for c in the row's adapter's columns: work items are (adapter, rank column), each
  // A row read once for all rows of its adapter
  at::parallel_for(0, n_items, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t c = item_c[it];
      over_tiles(rows[item_g[it]], [&](const int64_t* rp, auto tile) {
        constexpr int N = decltype(tile)::value;
        const float* xr[N];
        float res[N];
        for (int r = 0; r < N; ++r) xr[r] = xp + rp[r] * xs;
        dots<W, N>(ap + c * in, xr, in, res);
        for (int r = 0; r < N; ++r) t[rp[r] * R + c] = res[r];
      });
    }
  });
  // out[i, o0 : o1] += t[i, c] * Bt[c, o0 : o1] for the ranks c of the row's adapter's block that holds
  // [o0, o1): contiguous axpys over output rows (no horizontal sums), the chunk of Bt in cache for all rows of
  // its adapter; threads take disjoint output chunks, and each element's sum runs over c in order
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n_out, 64, [&](int64_t o_lo, int64_t o_hi) {
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
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g].empty()) continue;
    for (int64_t c = c0[g]; c < c1[g]; ++c) item_g.push_back(g), item_c.push_back(c);
  }
  if (item_g.empty()) return;
  if (bf16) {
    sgmv<bf16_t>(x, bl, S, rows, item_g, item_c, R, reinterpret_cast<const bf16_t*>(A.data_ptr()),
                 reinterpret_cast<const bf16_t*>(Bt.data_ptr()), out);
  } else {
    sgmv<float>(x, bl, S, rows, item_g, item_c, R, A.data_ptr<float>(), Bt.data_ptr<float>(), out);
  }
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("lora_sgmv", &radixserve::lora_sgmv); }
