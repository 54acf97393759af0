// lora_sgmv: the LoRA deltas of one projection for every row of a step, each row with its own adapter
// (Punica's "segmented gather matrix-vector", SGMV, on the CPU):
//
//   out[i] += B_g . (A_g . x[i])   for every row i whose adapter is g (row_group[i] = g; -1 = base row)
//
// The step's adapters lie side by side (lora/lora_dense.py): A [ranks, in], Bt = B^T [ranks, out], adapter g owning
// some rank columns (scaling folded into B). blocks [S, 5] = (g, o0, on, r0, rn): output rows [o0, o0 + on)
// of adapter g use its ranks [r0, r0 + rn): one block per shard of a stacked projection (qkv, gate_up),
// whose B is block diagonal, so only those ranks are read and multiplied and the zeros never touched. Each adapter's weights are read once per step however many rows
// use it, and no row pays for another adapter's ranks (the dense side-by-side form did: every row against
// every adapter, 8x the work at 8 adapters).
//
// Two parallel regions per call: t = A . x over (adapter, rank) items, then the deltas over chunks of output
// rows (axpys along B's transposed rows). Summation orders are fixed by this code (no dependence on the
// batch), so a row's delta is the same alone or batched.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"

namespace radixserve {
namespace {

// Eight-lane vectors written out (GCC vector extensions, unaligned loads, a zero-padded tail), so the
// summation order is fixed by this code: with -ffast-math the compiler would otherwise vectorise a plain
// loop with a peel that depends on the pointers' alignment, and the same row would round differently
// alone and batched.
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// y[o] += sum over c in [c0, c0 + cn) of tc[c] * bt[c * ld + o], for o in [lo, hi), c in order: 16 outputs
// at a time held in registers across the ranks (one load and one store of y per 16 outputs, not per rank)
inline void add_ranks(float* y, const float* bt, int64_t ld, const float* tc, int64_t c0, int64_t cn, int64_t lo,
                      int64_t hi) {
  int64_t o = lo;
  for (; o + 16 <= hi; o += 16) {
    v8f y0 = load8(y + o), y1 = load8(y + o + 8);
    for (int64_t c = c0; c < c0 + cn; ++c) {
      const float a = tc[c];
      const v8f av = {a, a, a, a, a, a, a, a};
      const float* row = bt + c * ld + o;
      y0 += av * load8(row);
      y1 += av * load8(row + 8);
    }
    store8(y + o, y0);
    store8(y + o + 8, y1);
  }
  for (; o < hi; ++o) {
    float acc = y[o];
    for (int64_t c = c0; c < c0 + cn; ++c) acc += tc[c] * bt[c * ld + o];
    y[o] = acc;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  v8f acc0 = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, acc1 = acc0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    acc0 += load8(a + j) * load8(b + j);
    acc1 += load8(a + j + 8) * load8(b + j + 8);
  }
  if (j + 8 <= n) {
    acc0 += load8(a + j) * load8(b + j);
    j += 8;
  }
  if (j < n) {
    float ta[8] = {0.f}, tb[8] = {0.f};
    std::memcpy(ta, a + j, sizeof(float) * (n - j));
    std::memcpy(tb, b + j, sizeof(float) * (n - j));
    acc1 += load8(ta) * load8(tb);
  }
  const v8f s = acc0 + acc1;
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
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
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.dim() == 2 && A.size(1) == in,
              "lora_sgmv: A must be float32 contiguous [ranks, ", in, "]");
  const int64_t R = A.size(0);
  TORCH_CHECK(Bt.scalar_type() == at::kFloat && Bt.is_contiguous() && Bt.dim() == 2 && Bt.size(0) == R &&
                  Bt.size(1) == n_out, "lora_sgmv: Bt must be float32 contiguous [", R, ", ", n_out, "] (B transposed)");
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
  // t[i, c] = A[c] . x[i] for c in the row's adapter's columns: work items are (adapter, rank column), each
  // A row read once for all rows of its adapter
  std::vector<int64_t> item_g, item_c;
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g].empty()) continue;
    for (int64_t c = c0[g]; c < c1[g]; ++c) item_g.push_back(g), item_c.push_back(c);
  }
  const int64_t n_items = static_cast<int64_t>(item_g.size());
  if (n_items == 0) return;
  std::vector<float> t(static_cast<size_t>(M) * R);  // [M, R]: row i's ranks at t[i * R + c]
  const float* xp = x.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n_items, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t c = item_c[it];
      for (int64_t i : rows[item_g[it]]) t[i * R + c] = dot(ap + c * in, xp + i * xs, in);
    }
  });
  // out[i, o0 : o1] += t[i, c] * Bt[c, o0 : o1] for the ranks c of the row's adapter's block that holds
  // [o0, o1): contiguous axpys over output rows (no horizontal sums), the chunk of Bt in cache for all rows of
  // its adapter; threads take disjoint output chunks, and each element's sum runs over c in order
  float* op = out.data_ptr<float>();
  const float* btp = Bt.data_ptr<float>();
  at::parallel_for(0, n_out, 64, [&](int64_t o_lo, int64_t o_hi) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t* b = bl + 5 * s;
      const std::vector<int64_t>& rs = rows[b[0]];
      if (rs.empty() || b[4] == 0) continue;
      const int64_t lo = std::max(o_lo, b[1]), hi = std::min(o_hi, b[1] + b[2]);
      if (lo >= hi) continue;
      for (int64_t i : rs) add_ranks(op + i * n_out, btp, n_out, t.data() + i * R, b[3], b[4], lo, hi);
    }
  });
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("lora_sgmv", &radixserve::lora_sgmv); }
