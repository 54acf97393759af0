// fused_experts: a mixture-of-experts layer's routed experts for every token of a step, on the experts'
// own low-bit blocks (the GGUF file's 3-D ffn_{gate,up,down}_exps tensors, converted without loss to the
// kernel kinds of quant_linear.h; layers/moe/experts.py stacks them):
//
//   out[t] = sum over slots j of w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]
//
// for the experts this rank holds (global ids expert_offset .. expert_offset + E_local; a pair routed to
// another rank adds nothing here: expert parallelism sums the ranks' outputs afterwards).
//
//   1. the step's (token, slot) pairs are grouped by expert (stable: each expert sees its tokens in order)
//      and their rows gathered and quantised once, so each selected expert's weights are read once per
//      step however many tokens chose it; an expert no token chose is never touched;
//   2. gate_up: work items are (expert, block of 8-row weight groups) over that expert's rows, each thread
//      a contiguous run of items of equal cost (a hot expert's items spread over every thread, a cold
//      one's cost nothing);
//   3. the gated activation (decoder_glue.cpp's, the same floats as the dense MLP), re-quantised;
//   4. down: the same (expert, row block) items;
//   5. each token sums its own slots in slot order (never in expert order), so a token's result is the
//      same alone or batched, whatever the others chose.
// Op schema: ops.cpp; the plain-PyTorch reference is layers/moe/fused_experts.py.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "quant_linear.h"

namespace radixserve {
namespace {

constexpr int64_t kGroupsPerItem = 4;  // 32 output rows: enough items to balance two threads at one row

// One expert projection of every local expert: expert e's blocks start e * stride past expert 0's.
struct StackedQMat {
  QMat first;
  int64_t data_stride = 0, scale_stride = 0;  // bytes of data, bytes of scales (and mins) per expert
  int64_t E = 0;

  QMat expert(int64_t e) const {
    QMat w = first;
    w.data = static_cast<const char*>(first.data) + e * data_stride;
    w.d = static_cast<const char*>(first.d) + e * scale_stride;
    if (first.m != nullptr) w.m = static_cast<const char*>(first.m) + e * scale_stride;
    return w;
  }
};

StackedQMat stacked_from_tensors(int64_t kind, int64_t N, int64_t K, const at::Tensor& data, const at::Tensor& d,
                                 const c10::optional<at::Tensor>& m, const char* what) {
  const QKindInfo* info = qkind_info(kind);
  TORCH_CHECK(info != nullptr, what, ": unknown weight kind ", kind);
  TORCH_CHECK(!info->has_min || m.has_value(), what, ": ", info->name, " needs its mins");
  TORCH_CHECK(data.dim() == 2 && d.dim() == 2 && data.size(0) >= 1 && d.size(0) == data.size(0) &&
                  data.is_contiguous() && d.is_contiguous(),
              what, ": data and scales must be contiguous [experts, ...] with one row per expert");
  StackedQMat s;
  s.E = data.size(0);
  // every row holds one expert's matrix (checked as E matrices back to back, without a select per tensor:
  // six ATen selects a layer showed in a decode step's profile); mins like the scales
  if (info->has_min) {
    TORCH_CHECK(m->dim() == 2 && m->sizes() == d.sizes() && m->is_contiguous(), what, ": mins must be shaped like the scales");
  }
  s.first = qmat_from_tensors(kind, N, K, data, d, info->has_min ? *m : d, what, s.E);
  s.data_stride = data.size(1) * data.element_size();
  s.scale_stride = d.size(1) * d.element_size();
  return s;
}

struct Item {
  int64_t e, g0, g1;
};

// Runs fn(item) for every item, each thread one contiguous run of items of about equal cost (rows x groups):
// contiguous, because a thread streaming its own stretch of one expert's weights ran the 2-thread decode
// step 1.9x faster than threads pulling interleaved items from a shared counter (measured: 16 layers of
// 4-of-32 experts, 1 row, Zen 5: 6.0 vs 3.1 ms); weighted, so a hot expert's rows still spread over every
// thread.
template <typename Fn>
void for_each_item(const std::vector<Item>& items, const std::vector<int64_t>& start, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  std::vector<int64_t> cost(n + 1, 0);  // prefix sums
  for (int64_t i = 0; i < n; ++i) {
    const Item& it = items[i];
    cost[i + 1] = cost[i] + (start[it.e + 1] - start[it.e]) * (it.g1 - it.g0);
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  parallel_for(0, threads, 1, [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t) {
      // items whose cost midpoint falls in this thread's share [t, t + 1) * total / threads
      const int64_t lo = cost[n] * t / threads, hi = cost[n] * (t + 1) / threads;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t mid = (cost[i] + cost[i + 1]) / 2;
        if (mid >= lo && (mid < hi || t + 1 == threads)) fn(i);
      }
    }
  });
}

// Items (expert, groups g0 .. g1) for every expert with rows, for a projection of G groups.
std::vector<Item> expert_items(const std::vector<int64_t>& start, int64_t G) {
  std::vector<Item> items;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e) {
    if (start[e + 1] == start[e]) continue;
    for (int64_t g = 0; g < G; g += kGroupsPerItem) items.push_back({e, g, std::min(G, g + kGroupsPerItem)});
  }
  return items;
}

// One projection of the gathered rows: work items (expert, row block) over every expert with rows, each
// expert's rows start[e] .. start[e + 1] against its own weights, into out (ldo floats a row).
void project(const StackedQMat& w, const std::vector<int64_t>& start, const Q8ActRows& rows, float* out,
             int64_t ldo) {
  const std::vector<Item> items = expert_items(start, w.first.G);
  for_each_item(items, start, [&](int64_t i) {
    const Item& it = items[i];
    qgemm_range(w.expert(it.e), rows, out, ldo, it.g0, it.g1, start[it.e], start[it.e + 1]);
  });
}

}  // namespace

void fused_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   int64_t expert_offset, int64_t kind13, int64_t n13, const at::Tensor& data13,
                   const at::Tensor& d13, const c10::optional<at::Tensor>& m13, int64_t kind2,
                   const at::Tensor& data2, const at::Tensor& d2, const c10::optional<at::Tensor>& m2,
                   int64_t act, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "fused_experts: x must be float32 [tokens, hidden] contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_ids.is_contiguous(),
              "fused_experts: topk_ids must be int64 [tokens, k] contiguous");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.is_contiguous(),
              "fused_experts: topk_weights must be float32 shaped like topk_ids");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "fused_experts: out must be float32 [tokens, hidden] like x");
  TORCH_CHECK(act == 0 || act == 1, "fused_experts: act must be 0 (silu) or 1 (gelu_tanh), got ", act);
  TORCH_CHECK(n13 > 0 && n13 % 2 == 0, "fused_experts: the gate_up rows (", n13, ") must be gate then up, even");
  const int64_t inter = n13 / 2;
  const StackedQMat w13 = stacked_from_tensors(kind13, n13, H, data13, d13, m13, "fused_experts gate_up");
  const StackedQMat w2 = stacked_from_tensors(kind2, H, inter, data2, d2, m2, "fused_experts down");
  TORCH_CHECK(w13.E == w2.E, "fused_experts: ", w13.E, " gate_up experts but ", w2.E, " down experts");
  const int64_t E = w13.E;
  out.zero_();
  if (T == 0) return;

  // 1. pairs grouped by local expert (counting sort: stable), pos[p] = the pair's row in the gathered rows
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), pos(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - expert_offset;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t P = start[E];
  if (P == 0) return;
  std::vector<int64_t> fill(start.begin(), start.end() - 1), token(P);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - expert_offset;
    if (e < 0 || e >= E) continue;
    pos[p] = fill[e]++;
    token[pos[p]] = p / k;
  }
  at::Tensor xs = at::empty({P, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  parallel_for(0, P, std::max<int64_t>(1, 16384 / H), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) std::copy(xp + token[r] * H, xp + (token[r] + 1) * H, xsp + r * H);
  });
  // reused across calls; the worker threads read it through this reference (a lambda naming a
  // thread_local directly would reach each worker's own, empty, instance)
  thread_local Q8ActRows act_buffer;
  Q8ActRows& act_rows = act_buffer;
  quantize_rows_q8(xsp, P, H, H, act_rows);

  // 2. gate_up of every pair, by (expert, row block)
  at::Tensor h = at::empty({P, n13}, x.options());
  project(w13, start, act_rows, h.data_ptr<float>(), n13);

  // 3. act(gate) * up, re-quantised for the down projection
  at::Tensor a = at::empty({P, inter}, x.options());
  if (act == 0) {
    silu_and_mul(h, a);
  } else {
    gelu_tanh_and_mul(h, a);
  }
  quantize_rows_q8(a.data_ptr<float>(), P, inter, inter, act_rows);

  // 4. down, by (expert, row block)
  at::Tensor y = at::empty({P, H}, x.options());
  project(w2, start, act_rows, y.data_ptr<float>(), H);

  // 5. each token's slots in slot order
  const float* wts = topk_weights.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, T, std::max<int64_t>(1, 4096 / H), [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t) {
      float* o = op + t * H;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = pos[t * k + j];
        if (r < 0) continue;
        const float wj = wts[t * k + j];
        const float* src = yp + r * H;
        for (int64_t c = 0; c < H; ++c) o[c] += wj * src[c];
      }
    }
  });
}

}  // namespace radixserve

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("fused_experts", &radixserve::fused_experts); }
