// C++ entry points of the ops declared in ops.cpp, for native code that composes them (the fused
// decode stack in decode_stack.cpp calls the same functions Python reaches through torch.ops).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace radixserve {

// Every kernel shares work through this at::parallel_for, so that `bench one-batch --profile` can count the
// parallel regions a step really opens (each wakes the pool and joins it). at::parallel_for opens one only
// when its range holds more than one grain, and then a chunk always runs on pool thread 1; a range it runs
// inline (one decode row through a row-parallel norm, or any call made inside a region) is not counted.
std::atomic<int64_t>& parallel_regions();  // ops.cpp: regions opened since the library loaded

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const bool outer = !at::in_parallel_region();
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    if (outer && at::get_thread_num() == 1) parallel_regions().fetch_add(1, std::memory_order_relaxed);
    f(b, e);
  });
}

// decoder_glue.cpp
void fused_add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache);
void silu_and_mul(const at::Tensor& x, at::Tensor& out);
void gelu_tanh_and_mul(const at::Tensor& x, at::Tensor& out);
void embedding_q8_0(const at::Tensor& blocks, const at::Tensor& ids, at::Tensor& out);

// paged_attention.cpp. window (0 = global) and softcap (0 = none): attn_common.h
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                     const at::Tensor& seq_lens, int64_t L, double scale, int64_t window, double softcap,
                     at::Tensor& out);
// The argument rules of the variable-length attention ops (paged_attention_varlen, extend_attention):
// dtypes, layout, one entry per request, query rows inside q, seq_lens inside the slot table, the
// slots the window lets a query read inside the pool, window >= 0, softcap finite and >= 0. `op`
// names the caller in the error.
void check_varlen_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& kv_idx, const at::Tensor& seq_lens, const at::Tensor& q_start,
                            const at::Tensor& q_lens, const at::Tensor& out, int64_t window, double softcap);

// lora_sgmv.cpp: out[i] += B_g . (A_g . x[i]) for each row i of adapter g = row_group[i] (-1: none)
void lora_sgmv(const at::Tensor& x, const at::Tensor& row_group, const at::Tensor& A, const at::Tensor& Bt,
               const at::Tensor& blocks, at::Tensor& out);

// fused_experts.cpp: a MoE layer's routed experts on their stacked low-bit blocks (schema in ops.cpp)
void fused_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   int64_t expert_offset, int64_t kind13, int64_t n13, const at::Tensor& data13,
                   const at::Tensor& d13, const c10::optional<at::Tensor>& m13, int64_t kind2,
                   const at::Tensor& data2, const at::Tensor& d2, const c10::optional<at::Tensor>& m2,
                   int64_t act, at::Tensor& out);

// repack.cpp: a GGUF K-quant tensor's raw rows into quant_linear's layout (schema in ops.cpp)
bool repack_kquant(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d,
                   const c10::optional<at::Tensor>& m);
bool repack_kquant_m16(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d, at::Tensor& m);
bool repack_legacy(const at::Tensor& raw, int64_t qtype, at::Tensor& data, at::Tensor& d,
                   const c10::optional<at::Tensor>& m);

}  // namespace radixserve
