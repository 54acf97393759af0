// Every native CPU op of radixserve, declared once: `torch.ops.radixserve_cpu.<name>`. One source per
// op family implements them (paged_attention.cpp, flash_attention.cpp, decoder_glue.cpp, quant_linear.cpp, lora_sgmv.cpp, fused_experts.cpp, repack.cpp;
// decode_stack.cpp adds the DecodeStack class); a new op is declared here and
// implemented in its family's file (or a new one, listed in loader.py's SOURCES).
#include <torch/library.h>

#include "ops.h"

namespace radixserve {
std::atomic<int64_t>& parallel_regions() {
  static std::atomic<int64_t> n{0};
  return n;
}
}  // namespace radixserve

TORCH_LIBRARY(radixserve_cpu, m) {
  // attention: window = the layer's sliding window (0 = global), softcap = its logit soft-cap (0 = none),
  // as RadixAttention.window_arg / cap_arg pass them (csrc/attn_common.h)
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor kv_idx, Tensor seq_lens, int L, float scale, "
        "int window, float softcap, Tensor(a!) out) -> ()");
  m.def("paged_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor kv_idx, Tensor seq_lens, Tensor q_start, "
        "Tensor q_lens, float scale, int window, float softcap, Tensor(a!) out) -> ()");
  // long query blocks (PREFILL / EXTEND): tiled, online softmax, K/V read in place (flash_attention.cpp)
  // q_last: each row's last visible key position where it is past the row's own (image spans that attend both ways)
  m.def("extend_attention(Tensor q, Tensor k, Tensor v, Tensor kv_idx, Tensor seq_lens, Tensor q_start, "
        "Tensor q_lens, float scale, int window, float softcap, Tensor(a!) out, Tensor? q_last=None) -> ()");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("gelu_tanh_and_mul(Tensor x, Tensor(a!) out) -> ()");
  // the greedy sampler: torch.argmax(logits, -1) of float32 [rows, vocab] (decoder_glue.cpp)
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  // the rows `ids` of a GGUF Q8_0 token table (uint8 [rows, K / 32 * 34], the mapped file's bytes) as float32 [n, K]
  m.def("embedding_q8_0(Tensor blocks, Tensor ids, Tensor(a!) out) -> ()");
  // LoRA deltas of one projection, each row with its own adapter (lora_sgmv.cpp; layout: lora/lora_dense.py)
  m.def("lora_sgmv(Tensor x, Tensor row_group, Tensor A, Tensor Bt, Tensor blocks, Tensor(a!) out) -> ()");
  // a MoE layer's routed experts on their stacked low-bit blocks ([experts, ...] per projection, kinds as
  // quant_linear's; act 0 = silu, 1 = gelu_tanh): fused_experts.cpp
  m.def("fused_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, int expert_offset, int kind13, int n13, "
        "Tensor data13, Tensor d13, Tensor? m13, int kind2, Tensor data2, Tensor d2, Tensor? m2, int act, "
        "Tensor(a!) out) -> ()");
  // kind: quant_linear.h QKind (0 = Q8_0, 1 = Q4_1, 2 = Q8_M, 3 = Q8_16, 4 = Q8_M16, 5 = Q5, 6 = Q6; m for kinds with
  // mins), n output rows, in 8-row interleaved groups: layout in quant_linear.h
  m.def("quant_linear(Tensor x, int kind, int n, Tensor data, Tensor d, Tensor? m, Tensor? bias, Tensor(a!) out) -> ()");
  // a GGUF Q4_K (12) / Q6_K (14) tensor's raw block rows into quant_linear's layout (repack.cpp); false: a
  // non-finite float16 scale, left to the Python path
  m.def("repack_kquant(Tensor raw, int qtype, Tensor(a!) data, Tensor(b!) d, Tensor(c!)? m) -> bool");
  m.def("repack_kquant_m16(Tensor raw, int qtype, Tensor(a!) data, Tensor(b!) d, Tensor(c!) m) -> bool");
  m.def("repack_legacy(Tensor raw, int qtype, Tensor(a!) data, Tensor(b!) d, Tensor(c!)? m) -> bool");
}
