// Every native CPU op of radixserve, declared once: `torch.ops.radixserve_cpu.<name>`. One source per
// op family implements them (paged_attention.cpp, decoder_glue.cpp, quant_linear.cpp); a new op is declared here and
// implemented in its family's file (or a new one, listed in loader.py's SOURCES).
#include <torch/library.h>

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor kv_idx, Tensor seq_lens, int L, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("paged_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor kv_idx, Tensor seq_lens, Tensor q_start, "
        "Tensor q_lens, float scale, Tensor(a!) out) -> ()");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, Tensor(a!) out) -> ()");
}
