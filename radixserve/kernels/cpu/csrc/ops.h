// C++ entry points of the ops declared in ops.cpp, for native code that composes them (the fused
// decode stack in decode_stack.cpp calls the same functions Python reaches through torch.ops).
#pragma once

#include <ATen/ATen.h>

namespace radixserve {

// decoder_glue.cpp
void fused_add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache);
void silu_and_mul(const at::Tensor& x, at::Tensor& out);

// paged_attention.cpp
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_idx,
                     const at::Tensor& seq_lens, int64_t L, double scale, at::Tensor& out);
// The argument rules of the variable-length attention ops (paged_attention_varlen, extend_attention):
// dtypes, layout, one entry per request, query rows inside q, seq_lens inside the slot table, slots
// inside the pool. `op` names the caller in the error.
void check_varlen_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& kv_idx, const at::Tensor& seq_lens, const at::Tensor& q_start,
                            const at::Tensor& q_lens, const at::Tensor& out);

}  // namespace radixserve
