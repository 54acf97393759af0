// The whole decoder stack of a Llama-, Qwen3- or Gemma-family model for the few rows of a DECODE or
// TARGET_VERIFY step, as one native call: radixserve's CPU counterpart of a captured CUDA graph
// (model_executor/cpu_graph_runner.py builds it once and replays it each step). Python stays the source of truth for the model: this
// object holds views of the same weights, norms, RoPE caches and KV pool, and runs the same ops
// (ops.h, quant_linear.h) in the same order as models/base.py's DecoderLayer.forward with low-bit weights.
//
// Why: at batch 1 the per-layer Python path dispatches ~12 torch ops per layer (views, splits, the
// KV write, norms, RoPE, attention, four linears), each with its allocation and OpenMP region;
// that overhead was ~12 ms of a ~20 ms step on the 2-core dev machine while the int8 linears took
// ~7.6 ms. Here a step crosses into Python once and allocates only the hidden state it returns.
//
// Per layer l (weights of any kind in quant_linear.h: QKind; [..] = the layer's options):
//   x, residual = add_rms_norm(x, residual, in_norm)      (layer 0: residual = x, x = rms_norm(x))
//   qkv = x . Wqkv^T [+ bias];  [QK-norm: rms_norm of each q and k head]
//   RoPE on the q and k heads with the layer's cos/sin;  k, v -> KV pool rows out_loc
//   a = paged_attention(q, pool, kv_idx, seq_lens, [window], [softcap]);  x = a . Wo^T
//   pre:       x, residual = add_rms_norm(x, residual, post_norm);  x = down(act(gate) * up)
//   sandwich:  x = rms_norm(x, post_norm);  x, residual = add_rms_norm(x, residual, pre_ff_norm)
//              x = rms_norm(down(act(gate) * up), post_ff_norm)
//   act = silu or gelu_tanh
//   a MoE layer (add_moe_layer) replaces down(act(gate) * up) by SparseMoeBlock's: router logits x . Wr^T
//   (float32, at::linear as nn.Linear), softmax, top-k [renormalised], then fused_experts (fused_experts.cpp)
//   on the experts' stacked low-bit blocks; each step's tokens per expert are kept (expert_counts())
// then x = add_rms_norm(x, residual, final_norm) is returned (the LM head stays in Python; so do
// Gemma's embedding scale and final-logit soft-cap, which lie outside the stack).
//
// LoRA (forward_lora): after each projection, each row's own adapter delta (row_group[i]: its adapter in the
// bound set, -1 = base) through lora_sgmv (lora_sgmv.cpp), the op the layer-by-layer path calls
// (DenseLoRA.apply), so the floats equal that path's.
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attn_common.h"
#include "bf16.h"
#include "kv_quant.h"
#include "ops.h"
#include "quant_linear.h"

namespace radixserve {
namespace {

enum class Activation { Silu, GeluTanh };

// Where a step's time goes, for `radixserve bench one-batch --profile` (bench/decode_profile.py): each phase's
// wall time, calls, weight bytes read and int8 multiply-adds x 2, summed over steps while profiling is on.
// Off (the default) it costs one branch per phase; on, two steady_clock reads (~20 ns each) per phase.
enum Phase : int { kNorm, kActQuant, kQkv, kRopeKv, kAttention, kO, kGateUp, kActFn, kDown, kMoe, kStep, kPhases };
constexpr std::array<const char*, kPhases> kPhaseNames = {
    "rms_norm", "act_quant", "qkv_proj", "rope_kv_write", "attention", "o_proj", "gate_up_proj", "act_fn",
    "down_proj", "moe", "stack_total"};

struct PhaseClock {
  bool on = false;
  std::array<int64_t, kPhases> ns{}, calls{}, bytes{}, ops{};
  using Clock = std::chrono::steady_clock;
  Clock::time_point start() const { return on ? Clock::now() : Clock::time_point(); }
  void stop(Phase p, Clock::time_point t0, int64_t nbytes = 0, int64_t nops = 0) {
    if (!on) return;
    ns[p] += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    calls[p] += 1, bytes[p] += nbytes, ops[p] += nops;
  }
};

inline int64_t tensors_bytes(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  return a.nbytes() + b.nbytes() + c.nbytes();
}

struct LoraProj {  // one projection's side-by-side adapters (lora/lora_dense.py); undefined A = none
  at::Tensor A, Bt, blocks;  // Bt = B transposed [ranks, out]
};

struct StackLayer {
  at::Tensor in_norm, post_norm, qkv_bias, k_buf, v_buf;
  std::vector<at::Tensor> keep;  // owns the weight tensors the QMats point into
  QMat qkv, o, gate_up, down;
  int64_t qkv_bytes = 0, o_bytes = 0, gate_up_bytes = 0, down_bytes = 0;  // their blocks' bytes (the profile)
  // the layer's arithmetic (models/base.py LayerArithmetic); an undefined norm = not this layer's
  at::Tensor cos, sin;                      // its RoPE base's caches (Gemma 3: local and global differ)
  at::Tensor q_norm, k_norm;                // QK-norm (Qwen3, Gemma 3)
  at::Tensor pre_ff_norm, post_ff_norm;     // sandwich norms (Gemma 2/3)
  int64_t window = 0;                       // sliding window, 0 = global
  double softcap = 0.0;                     // attention logit soft-cap, 0 = none
  Activation act = Activation::Silu;
  // a MoE layer's routed experts (no shared expert): router [E, hidden] float32, stacked gate_up / down
  bool moe = false;
  at::Tensor router, w13_data, w13_d, w13_m, w2_data, w2_d, w2_m;
  int64_t top_k = 0, kind13 = 0, kind2 = 0, moe_inter = 0;
  bool renormalize = false;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              double scale, at::Tensor final_norm)
      : H_(hidden), Hq_(heads), Hkv_(kv_heads), D_(head_dim), I_(intermediate), eps_(eps), scale_(scale),
        final_norm_(std::move(final_norm)) {
    TORCH_CHECK(H_ > 0 && Hq_ > 0 && Hkv_ > 0 && Hq_ % Hkv_ == 0 && D_ > 0 && D_ % 2 == 0 && I_ > 0,
                "DecodeStack: bad dimensions");
    check_vec(final_norm_, H_, "final_norm");
  }

  // t = [in_norm, post_norm, qkv_bias (empty = none), k_buf, v_buf,
  //      qkv data, d, m, o data, d, m, gate_up data, d, m, down data, d, m]  (m empty for kinds without mins)
  // kinds = [qkv, o, gate_up, down] (QKind ids, each checked by qmat_from_tensors); shapes follow from the model's dimensions
  // arith = [cos_cache, sin_cache, q_norm, k_norm, pre_ff_norm, post_ff_norm] (norms empty = none),
  // window (0 = global), softcap (0 = none), activation "silu" | "gelu_tanh": see set_arithmetic
  void add_layer(std::vector<at::Tensor> t, std::vector<int64_t> kinds, std::vector<at::Tensor> arith,
                 int64_t window, double softcap, std::string activation) {
    TORCH_CHECK(t.size() == 17 && kinds.size() == 4, "DecodeStack.add_layer: 17 tensors and 4 kinds");
    StackLayer L = attention_part(t, kinds);
    L.keep.assign(t.begin() + 5, t.end());
    L.gate_up = qmat_from_tensors(kinds[2], 2 * I_, H_, t[11], t[12], t[13], "DecodeStack gate_up_proj");
    L.down = qmat_from_tensors(kinds[3], H_, I_, t[14], t[15], t[16], "DecodeStack down_proj");
    L.gate_up_bytes = tensors_bytes(t[11], t[12], t[13]), L.down_bytes = tensors_bytes(t[14], t[15], t[16]);
    set_arithmetic(L, arith, window, softcap, activation);
    push_layer(std::move(L));
  }

  // A MoE layer: t and kinds as add_layer's for qkv and o (t[11..16] and kinds[2..3], the dense MLP's, are not
  // read), moe = [router, gate_up data, d, m, down data, d, m] (m empty for kinds without mins), ints =
  // [top_k, renormalize, gate_up kind, down kind, expert intermediate size]. fused_experts checks the experts'
  // tensors on each call (as the layer-by-layer path's op does).
  void add_moe_layer(std::vector<at::Tensor> t, std::vector<int64_t> kinds, std::vector<at::Tensor> arith,
                     int64_t window, double softcap, std::string activation, std::vector<at::Tensor> moe,
                     std::vector<int64_t> ints) {
    TORCH_CHECK(t.size() == 17 && kinds.size() == 4 && moe.size() == 7 && ints.size() == 5,
                "DecodeStack.add_moe_layer: 17 tensors, 4 kinds, 7 expert tensors and 5 ints");
    const int64_t E = moe[0].dim() == 2 ? moe[0].size(0) : 0;
    TORCH_CHECK(moe[0].scalar_type() == at::kFloat && moe[0].is_contiguous() && E >= 1 && moe[0].size(1) == H_,
                "DecodeStack.add_moe_layer: router must be float32 [experts, ", H_, "]");
    TORCH_CHECK(ints[0] >= 1 && ints[0] <= E && ints[4] >= 1, "DecodeStack.add_moe_layer: top_k ", ints[0],
                " outside 1..", E, " or a bad expert size ", ints[4]);
    StackLayer L = attention_part(t, kinds);
    L.keep.assign(t.begin() + 5, t.begin() + 11);
    set_arithmetic(L, arith, window, softcap, activation);
    L.moe = true;
    L.router = moe[0], L.w13_data = moe[1], L.w13_d = moe[2], L.w13_m = moe[3];
    L.w2_data = moe[4], L.w2_d = moe[5], L.w2_m = moe[6];
    L.top_k = ints[0], L.renormalize = ints[1] != 0, L.kind13 = ints[2], L.kind2 = ints[3], L.moe_inter = ints[4];
    push_layer(std::move(L));
    max_experts_ = std::max(max_experts_, E);
  }

  // Tokens per expert of each layer in the last forward: int64 [layers, max experts] (a dense layer's row: 0;
  // undefined for a dense stack).
  at::Tensor expert_counts() const { return counts_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Profiling (PhaseClock): on = start counting from zero; profile() = int64 [phases, 4]: ns, calls, bytes, ops,
  // rows in profile_names()' order.
  void set_profile(bool on) { clock_ = PhaseClock(), clock_.on = on; }
  at::Tensor profile() const {
    at::Tensor t = at::empty({kPhases, 4}, at::kLong);
    auto a = t.accessor<int64_t, 2>();
    for (int p = 0; p < kPhases; ++p) a[p][0] = clock_.ns[p], a[p][1] = clock_.calls[p], a[p][2] = clock_.bytes[p],
                                      a[p][3] = clock_.ops[p];
    return t;
  }
  std::vector<std::string> profile_names() const { return {kPhaseNames.begin(), kPhaseNames.end()}; }

  // Parallel regions every kernel of this library has opened since it loaded (ops.h parallel_for): the
  // profile reads it before and after its steps.
  int64_t parallel_regions() const { return radixserve::parallel_regions().load(); }

  // The cost of one empty parallel region over every thread (wake, run nothing, join), averaged over `iters`:
  // with parallel_regions() a step, the profile can say how much of it is thread hand-offs.
  double parallel_region_ns(int64_t iters) const {
    const int64_t n = at::get_num_threads();
    std::vector<int64_t> sink(static_cast<size_t>(std::max<int64_t>(n, 1)) * 16, 0);  // one cache line each
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) sink[static_cast<size_t>(k) * 16] += 1;
      });
    }
    const auto dt = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    return static_cast<double>(dt.count()) / static_cast<double>(std::max<int64_t>(iters, 1));
  }

  // The adapters the next forward_lora steps apply: [A, Bt, blocks] for qkv, o, gate_up, down of layer 0,
  // then layer 1, ... (A empty = none); bound once per set of adapters, not per step.
  void set_lora(std::vector<at::Tensor> t) {
    const size_t per_layer = 12;
    TORCH_CHECK(t.size() == per_layer * layers_.size(), "DecodeStack.set_lora: [A, Bt, blocks] x 4 projections x ",
                layers_.size(), " layers");
    const int64_t qkv_n = (Hq_ + 2 * Hkv_) * D_;
    const int64_t dims[4][2] = {{H_, qkv_n}, {Hq_ * D_, H_}, {H_, 2 * I_}, {I_, H_}};  // in, out
    std::vector<std::array<LoraProj, 4>> lora(layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      for (int p = 0; p < 4; ++p) {
        const at::Tensor &A = t[l * per_layer + 3 * p], &Bt = t[l * per_layer + 3 * p + 1],
                         &blocks = t[l * per_layer + 3 * p + 2];
        if (A.numel() == 0) continue;
        const int64_t R = A.size(0);
        TORCH_CHECK((A.scalar_type() == at::kFloat || A.scalar_type() == at::kBFloat16) && A.is_contiguous() &&
                        A.dim() == 2 && A.size(1) == dims[p][0] && Bt.scalar_type() == A.scalar_type() &&
                        Bt.is_contiguous() && Bt.dim() == 2 && Bt.size(0) == R && Bt.size(1) == dims[p][1] &&
                        blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(1) == 5,
                    "DecodeStack.set_lora: layer ", l, " projection ", p, ": A float32 or bfloat16 [ranks, ",
                    dims[p][0], "], Bt in A's dtype [ranks, ", dims[p][1], "], blocks int64 [S, 5]");
        lora[l][p] = LoraProj{A, Bt, blocks.contiguous()};
      }
    }
    lora_ = std::move(lora);
  }

  // forward, plus each row's adapter delta on every projection (set_lora); row_group [M] int64: the adapter
  // (index into the set) of each row, -1 = the base model.
  at::Tensor forward_lora(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& out_loc,
                          const at::Tensor& kv_idx, const at::Tensor& seq_lens, int64_t L, const at::Tensor& row_group,
                          const at::Tensor& swa_loc, const at::Tensor& swa_kv_idx) {
    TORCH_CHECK(lora_.size() == layers_.size(), "DecodeStack.forward_lora: set_lora first");
    for (const StackLayer& Ly : layers_) {
      TORCH_CHECK(!Ly.moe, "DecodeStack.forward_lora: a MoE layer takes no adapters here");
    }
    TORCH_CHECK(row_group.scalar_type() == at::kLong && row_group.is_contiguous() && row_group.numel() == x_in.size(0),
                "DecodeStack.forward_lora: row_group must be int64 [M]");
    return run(x_in, positions, out_loc, kv_idx, seq_lens, L, &row_group, swa_loc, swa_kv_idx);
  }

  // x [M, hidden] (the embeddings; not modified), positions / out_loc [M] int64, M = nb * L rows:
  // nb requests of L query tokens each (DECODE: L = 1; TARGET_VERIFY: the last token + L - 1 drafts),
  // kv_idx [nb, max_len] int64 slot table, seq_lens [nb] int64 (this step's L tokens included).
  // A hybrid sliding-window pool (mem_cache/swa_memory_pool.py): swa_loc / swa_kv_idx are out_loc / kv_idx
  // through its full_to_swa, and every layer with a window writes and reads its buffers through them; empty
  // tensors: one pool, every layer reads out_loc / kv_idx.
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& out_loc,
                     const at::Tensor& kv_idx, const at::Tensor& seq_lens, int64_t L, const at::Tensor& swa_loc,
                     const at::Tensor& swa_kv_idx) {
    return run(x_in, positions, out_loc, kv_idx, seq_lens, L, nullptr, swa_loc, swa_kv_idx);
  }

 private:
  at::Tensor run(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& out_loc,
                 const at::Tensor& kv_idx, const at::Tensor& seq_lens, int64_t L, const at::Tensor* row_group,
                 const at::Tensor& swa_loc, const at::Tensor& swa_kv_idx) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == H_,
                "DecodeStack: x must be float32 [M, hidden]");
    const int64_t M = x_in.size(0);
    TORCH_CHECK(out_loc.scalar_type() == at::kLong && out_loc.is_contiguous() && out_loc.numel() == M,
                "DecodeStack: out_loc must be int64 [M]");
    TORCH_CHECK(L >= 1 && M % L == 0 && kv_idx.dim() == 2 && kv_idx.size(0) == M / L,
                "DecodeStack: kv_idx must be [M / L, max_len] for M = ", M, " rows of L = ", L);
    const bool hybrid = swa_loc.numel() > 0;
    TORCH_CHECK(!hybrid || (swa_loc.scalar_type() == at::kLong && swa_loc.is_contiguous() && swa_loc.numel() == M &&
                            swa_kv_idx.scalar_type() == at::kLong && swa_kv_idx.is_contiguous() &&
                            swa_kv_idx.sizes() == kv_idx.sizes()),
                "DecodeStack: swa_loc must be int64 [M] and swa_kv_idx shaped like kv_idx");
    const int64_t* loc = out_loc.data_ptr<int64_t>();
    const int64_t* swa_locp = hybrid ? swa_loc.data_ptr<int64_t>() : nullptr;
    // each layer's writes land inside its own buffers: every slot under the fewest any such layer has
    for (int64_t i = 0; i < M; ++i) {
      TORCH_CHECK(loc[i] >= 0 && loc[i] < (hybrid ? global_slots_ : all_slots_), "DecodeStack: out_loc ", loc[i],
                  " outside the pool of ", hybrid ? global_slots_ : all_slots_);
      TORCH_CHECK(!hybrid || window_slots_ == INT64_MAX || (swa_locp[i] >= 0 && swa_locp[i] < window_slots_),
                  "DecodeStack: swa_loc ", hybrid ? swa_locp[i] : 0, " outside the pool of ", window_slots_);
    }
    const auto f32 = x_in.options();
    const int64_t qkv_n = (Hq_ + 2 * Hkv_) * D_;
    at::Tensor x = x_in.contiguous().clone();  // the returned hidden state: the one allocation per step
    if (M != buf_rows_) {  // scratch for this row count, kept across steps (a few KB per row)
      residual_ = at::empty({M, H_}, f32), qkv_ = at::empty({M, qkv_n}, f32);
      q_ = at::empty({M, Hq_, D_}, f32), attn_ = at::empty({M, Hq_, D_}, f32);
      qn_ = at::empty({M * Hq_, D_}, f32), kn_ = at::empty({M * Hkv_, D_}, f32);
      gu_ = at::empty({M, 2 * I_}, f32), act_ = at::empty({M, I_}, f32);
      buf_rows_ = M;
    }
    at::Tensor& residual = residual_;
    at::Tensor& qkv = qkv_;
    at::Tensor& q = q_;
    at::Tensor& attn = attn_;
    at::Tensor& gu = gu_;
    at::Tensor& act = act_;
    // q and k heads are adjacent in each qkv row: one RoPE pass over [M, Hq + Hkv, D] with row stride qkv_n
    at::Tensor qk = qkv.as_strided({M, Hq_ + Hkv_, D_}, {qkv_n, D_, 1});
    const c10::optional<at::Tensor> no_residual;
    const c10::optional<at::Tensor> with_residual(residual);
    float* xp = x.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    // a fresh tensor a step: the caller may still hold the last one (a dense stack allocates none)
    if (max_experts_ > 0)
      counts_ = at::zeros({static_cast<int64_t>(layers_.size()), max_experts_}, x_in.options().dtype(at::kLong));
    PhaseClock& pc = clock_;
    const auto step0 = pc.start();
    const int64_t q_n = Hq_ * D_;
    auto gemm = [&](Phase p, const QMat& w, int64_t nbytes, const float* bias, float* out, int64_t ldo) {
      const auto t0 = pc.start();
      qgemm(w, act_q_, bias, out, ldo);
      pc.stop(p, t0, nbytes, 2 * M * w.N * w.K);
    };
    auto quantize = [&](const float* src, int64_t K) {
      const auto t0 = pc.start();
      quantize_rows_q8(src, M, K, K, act_q_);
      pc.stop(kActQuant, t0);
    };
    auto norm = [&](at::Tensor& t, const c10::optional<at::Tensor>& res, const at::Tensor& w) {
      const auto t0 = pc.start();
      fused_add_rms_norm_(t, res, w, eps_);
      pc.stop(kNorm, t0);
    };
    for (size_t l = 0; l < layers_.size(); ++l) {
      StackLayer& Ly = layers_[l];
      if (l == 0) {
        residual.copy_(x);
        norm(x, no_residual, Ly.in_norm);
      } else {
        norm(x, with_residual, Ly.in_norm);
      }
      quantize(xp, H_);
      gemm(kQkv, Ly.qkv, Ly.qkv_bytes, Ly.qkv_bias.numel() > 0 ? Ly.qkv_bias.data_ptr<float>() : nullptr, qkvp, qkv_n);
      if (row_group) lora_delta(lora_[l][0], x, qkv, *row_group);
      auto t0 = pc.start();
      if (Ly.q_norm.defined()) qk_norm(Ly, qkvp, M);
      rope_(qk, positions, Ly.cos, Ly.sin);
      float* qp = q.data_ptr<float>();
      for (int64_t i = 0; i < M; ++i) std::memcpy(qp + i * q_n, qkvp + i * qkv_n, sizeof(float) * q_n);
      const bool local = hybrid && Ly.window > 0;
      const int64_t* lp = local ? swa_locp : loc;
      if (Ly.k_buf.scalar_type() == at::kChar) {
        write_kv_q8(Ly.k_buf.data_ptr<int8_t>(), Ly.v_buf.data_ptr<int8_t>(), qkvp, qkv_n, lp, M);
      } else if (Ly.k_buf.scalar_type() == at::kFloat8_e4m3fn) {
        write_kv_f8(static_cast<uint8_t*>(Ly.k_buf.data_ptr()), static_cast<uint8_t*>(Ly.v_buf.data_ptr()), qkvp,
                    qkv_n, lp, M);
      } else if (Ly.k_buf.scalar_type() == at::kBFloat16) {
        write_kv(reinterpret_cast<bf16_t*>(Ly.k_buf.data_ptr()), reinterpret_cast<bf16_t*>(Ly.v_buf.data_ptr()),
                 qkvp, qkv_n, lp, M);
      } else {
        write_kv(Ly.k_buf.data_ptr<float>(), Ly.v_buf.data_ptr<float>(), qkvp, qkv_n, lp, M);
      }
      pc.stop(kRopeKv, t0);
      t0 = pc.start();
      paged_attention(q, Ly.k_buf, Ly.v_buf, local ? swa_kv_idx : kv_idx, seq_lens, L, scale_, Ly.window, Ly.softcap,
                      attn);
      pc.stop(kAttention, t0);
      quantize(attn.data_ptr<float>(), q_n);
      gemm(kO, Ly.o, Ly.o_bytes, nullptr, xp, H_);
      if (row_group) lora_delta(lora_[l][1], attn.view({M, q_n}), x, *row_group);
      const bool sandwich = Ly.pre_ff_norm.defined();
      if (sandwich) {  // the attention output is normed before it joins the residual
        norm(x, no_residual, Ly.post_norm);
        norm(x, with_residual, Ly.pre_ff_norm);
      } else {
        norm(x, with_residual, Ly.post_norm);
      }
      if (Ly.moe) {
        t0 = pc.start();
        moe_mlp(Ly, x, static_cast<int64_t>(l));
        pc.stop(kMoe, t0);
        if (sandwich) norm(x, no_residual, Ly.post_ff_norm);
        continue;
      }
      quantize(xp, H_);
      gemm(kGateUp, Ly.gate_up, Ly.gate_up_bytes, nullptr, gu.data_ptr<float>(), 2 * I_);
      if (row_group) lora_delta(lora_[l][2], x, gu, *row_group);
      t0 = pc.start();
      if (Ly.act == Activation::GeluTanh) {
        gelu_tanh_and_mul(gu, act);
      } else {
        silu_and_mul(gu, act);
      }
      pc.stop(kActFn, t0);
      quantize(act.data_ptr<float>(), I_);
      gemm(kDown, Ly.down, Ly.down_bytes, nullptr, xp, H_);
      if (row_group) lora_delta(lora_[l][3], act, x, *row_group);
      if (sandwich) norm(x, no_residual, Ly.post_ff_norm);
    }
    norm(x, with_residual, final_norm_);
    pc.stop(kStep, step0);
    return x;
  }

  // A layer's norms, KV buffers and attention projections from add_layer's t[0..10] and kinds[0..1].
  StackLayer attention_part(const std::vector<at::Tensor>& t, const std::vector<int64_t>& kinds) const {
    StackLayer L;
    L.in_norm = t[0], L.post_norm = t[1], L.qkv_bias = t[2], L.k_buf = t[3], L.v_buf = t[4];
    check_vec(L.in_norm, H_, "in_norm");
    check_vec(L.post_norm, H_, "post_norm");
    const int64_t qkv_n = (Hq_ + 2 * Hkv_) * D_;
    if (L.qkv_bias.numel() > 0) check_vec(L.qkv_bias, qkv_n, "qkv_bias");
    for (const at::Tensor* kv : {&L.k_buf, &L.v_buf}) {
      const auto t = kv->scalar_type();
      TORCH_CHECK((t == at::kFloat || t == at::kBFloat16 || t == at::kChar || t == at::kFloat8_e4m3fn) &&
                      t == L.k_buf.scalar_type() &&
                      kv->is_contiguous() && kv->dim() == 3 && kv->size(1) == Hkv_ && kv_row_ok(*kv, D_),
                  "DecodeStack.add_layer: KV buffers must be float32 or bfloat16 [slots, kv_heads, head_dim], or "
                  "int8 q8_0 blocks [slots, kv_heads, head_dim / 32 * 34], or fp8 rows [slots, kv_heads, head_dim + 4]");
    }
    L.qkv = qmat_from_tensors(kinds[0], qkv_n, H_, t[5], t[6], t[7], "DecodeStack qkv_proj");
    L.o = qmat_from_tensors(kinds[1], H_, Hq_ * D_, t[8], t[9], t[10], "DecodeStack o_proj");
    L.qkv_bytes = tensors_bytes(t[5], t[6], t[7]), L.o_bytes = tensors_bytes(t[8], t[9], t[10]);
    return L;
  }

  // x <- SparseMoeBlock(x) with the same ATen ops for the router as layers/moe/router.py (so the same
  // experts and weights) and the same fused_experts op, in place.
  void moe_mlp(const StackLayer& Ly, at::Tensor& x, int64_t l) {
    const at::Tensor probs = at::softmax(at::linear(x, Ly.router), -1);
    auto [weights, ids] = at::topk(probs, Ly.top_k, -1);
    if (Ly.renormalize) weights = weights / weights.sum(-1, true);
    ids = ids.contiguous();
    at::Tensor out = at::empty_like(x);
    const c10::optional<at::Tensor> m13 = Ly.w13_m.numel() > 0 ? c10::optional<at::Tensor>(Ly.w13_m) : c10::nullopt;
    const c10::optional<at::Tensor> m2 = Ly.w2_m.numel() > 0 ? c10::optional<at::Tensor>(Ly.w2_m) : c10::nullopt;
    fused_experts(x, ids, weights.contiguous(), 0, Ly.kind13, 2 * Ly.moe_inter, Ly.w13_data, Ly.w13_d, m13, Ly.kind2,
                  Ly.w2_data, Ly.w2_d, m2, Ly.act == Activation::GeluTanh ? 1 : 0, out);
    x.copy_(out);
    // tokens per expert, counted in place (an ATen bincount and its copy per layer cost ~15 us a layer)
    int64_t* cnt = counts_.data_ptr<int64_t>() + l * counts_.size(1);
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t p = 0; p < ids.numel(); ++p) ++cnt[id[p]];
  }

  static void lora_delta(const LoraProj& p, const at::Tensor& x, at::Tensor& out, const at::Tensor& row_group) {
    if (p.A.defined()) lora_sgmv(x, row_group, p.A, p.Bt, p.blocks, out);
  }

  // The layer's options (add_layer's arith, window, softcap, activation), checked against the model's
  // dimensions: a layer is Llama's unless they say otherwise.
  void set_arithmetic(StackLayer& L, const std::vector<at::Tensor>& arith, int64_t window, double softcap,
                      const std::string& activation) const {
    TORCH_CHECK(arith.size() == 6, "DecodeStack.add_layer: arith = [cos, sin, q_norm, k_norm, pre_ff_norm, "
                "post_ff_norm]");
    const at::Tensor &cos = arith[0], &sin = arith[1];
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 && cos.size(1) == D_ / 2 &&
                    sin.scalar_type() == at::kFloat && sin.is_contiguous() && sin.sizes() == cos.sizes(),
                "DecodeStack: the RoPE caches must be float32 [max_pos, head_dim / 2] (no partial rotary)");
    L.cos = cos, L.sin = sin;
    TORCH_CHECK((arith[2].numel() > 0) == (arith[3].numel() > 0), "DecodeStack: q_norm and k_norm come together");
    if (arith[2].numel() > 0) {
      check_vec(arith[2], D_, "q_norm");
      check_vec(arith[3], D_, "k_norm");
      L.q_norm = arith[2], L.k_norm = arith[3];
    }
    TORCH_CHECK((arith[4].numel() > 0) == (arith[5].numel() > 0),
                "DecodeStack: pre_ff_norm and post_ff_norm come together (sandwich norms)");
    if (arith[4].numel() > 0) {
      check_vec(arith[4], H_, "pre_ff_norm");
      check_vec(arith[5], H_, "post_ff_norm");
      L.pre_ff_norm = arith[4], L.post_ff_norm = arith[5];
    }
    check_window_softcap("DecodeStack", window, softcap);
    L.window = window, L.softcap = softcap;
    if (activation == "silu") {
      L.act = Activation::Silu;
    } else if (activation == "gelu_tanh") {
      L.act = Activation::GeluTanh;
    } else {
      TORCH_CHECK(false, "DecodeStack: activation must be silu or gelu_tanh, got ", activation);
    }
  }

  // Per-head RMSNorm of the q and k heads of each qkv row, in place. As Attention.forward does, the q
  // heads and the k heads are normed as the rows of contiguous [M * heads, head_dim] copies (the same
  // op on the same layout, so the floats equal the layer-by-layer path's), then written back for RoPE.
  void qk_norm(const StackLayer& Ly, float* qkvp, int64_t M) {
    const int64_t qkv_n = (Hq_ + 2 * Hkv_) * D_, q_n = Hq_ * D_, k_n = Hkv_ * D_;
    float* qn = qn_.data_ptr<float>();
    float* kn = kn_.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
      std::memcpy(qn + i * q_n, qkvp + i * qkv_n, sizeof(float) * q_n);
      std::memcpy(kn + i * k_n, qkvp + i * qkv_n + q_n, sizeof(float) * k_n);
    }
    const c10::optional<at::Tensor> no_residual;
    fused_add_rms_norm_(qn_, no_residual, Ly.q_norm, eps_);
    fused_add_rms_norm_(kn_, no_residual, Ly.k_norm, eps_);
    for (int64_t i = 0; i < M; ++i) {
      std::memcpy(qkvp + i * qkv_n, qn + i * q_n, sizeof(float) * q_n);
      std::memcpy(qkvp + i * qkv_n + q_n, kn + i * k_n, sizeof(float) * k_n);
    }
  }

  // this step's k and v heads of each row (after RoPE) -> the pool's slots out_loc, in the pool's dtype
  template <typename T>
  void write_kv(T* kp, T* vp, const float* qkvp, int64_t qkv_n, const int64_t* loc, int64_t M) const {
    const int64_t kv_row = Hkv_ * D_;
    for (int64_t i = 0; i < M; ++i) {
      const float* row = qkvp + i * qkv_n;
      store_row(kp + loc[i] * kv_row, row + Hq_ * D_, kv_row);
      store_row(vp + loc[i] * kv_row, row + (Hq_ + Hkv_) * D_, kv_row);
    }
  }

  // the same into an int8 pool's q8_0 blocks (kv_quant.h: the bits mem_cache/kv_quant.py writes)
  void write_kv_q8(int8_t* kp, int8_t* vp, const float* qkvp, int64_t qkv_n, const int64_t* loc, int64_t M) const {
    const int64_t kv_row = Hkv_ * D_;
    for (int64_t i = 0; i < M; ++i) {
      const float* row = qkvp + i * qkv_n;
      store_row_q8(kp, loc[i] * kv_row, row + Hq_ * D_, kv_row);
      store_row_q8(vp, loc[i] * kv_row, row + (Hq_ + Hkv_) * D_, kv_row);
    }
  }

  void write_kv_f8(uint8_t* kp, uint8_t* vp, const float* qkvp, int64_t qkv_n, const int64_t* loc, int64_t M) const {
    const int64_t kv_row = Hkv_ * D_;
    for (int64_t i = 0; i < M; ++i) {
      const float* row = qkvp + i * qkv_n;
      store_row_f8(kp, loc[i] * kv_row, row + Hq_ * D_, kv_row, D_);
      store_row_f8(vp, loc[i] * kv_row, row + (Hq_ + Hkv_) * D_, kv_row, D_);
    }
  }

  static void check_vec(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.numel() == n,
                "DecodeStack: ", what, " must be float32 [", n, "]");
  }

  int64_t H_, Hq_, Hkv_, D_, I_;
  double eps_, scale_;
  at::Tensor final_norm_;
  std::vector<StackLayer> layers_;
  // the fewest KV slots of any layer, of the global layers and of the windowed ones (INT64_MAX: none): a step's
  // slots are checked against these, not layer by layer (30 cold StackLayers a step, ~30 us on a Zen 3)
  int64_t all_slots_ = INT64_MAX, global_slots_ = INT64_MAX, window_slots_ = INT64_MAX;
  void push_layer(StackLayer L) {
    const int64_t slots = L.k_buf.size(0);
    all_slots_ = std::min(all_slots_, slots);
    int64_t& kind = L.window > 0 ? window_slots_ : global_slots_;
    kind = std::min(kind, slots);
    layers_.push_back(std::move(L));
  }
  std::vector<std::array<LoraProj, 4>> lora_;  // set_lora's adapters (empty: none bound)
  Q8ActRows act_q_;
  int64_t buf_rows_ = -1;
  at::Tensor residual_, qkv_, q_, attn_, gu_, act_, qn_, kn_;
  int64_t max_experts_ = 0;  // the widest MoE layer's experts (0: a dense stack)
  at::Tensor counts_;        // expert_counts()
  PhaseClock clock_;         // set_profile / profile
};

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.class_<radixserve::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &radixserve::DecodeStack::add_layer)
      .def("add_moe_layer", &radixserve::DecodeStack::add_moe_layer)
      .def("expert_counts", &radixserve::DecodeStack::expert_counts)
      .def("num_layers", &radixserve::DecodeStack::num_layers)
      .def("set_profile", &radixserve::DecodeStack::set_profile)
      .def("profile", &radixserve::DecodeStack::profile)
      .def("profile_names", &radixserve::DecodeStack::profile_names)
      .def("parallel_region_ns", &radixserve::DecodeStack::parallel_region_ns)
      .def("parallel_regions", &radixserve::DecodeStack::parallel_regions)
      .def("forward", &radixserve::DecodeStack::forward)
      .def("set_lora", &radixserve::DecodeStack::set_lora)
      .def("forward_lora", &radixserve::DecodeStack::forward_lora);
}
