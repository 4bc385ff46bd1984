// The ops kiln registers as torch.ops.kiln.* (ops.cpp), one declaration each, grouped by the
// file that defines them; the fused stack (stack.cpp) calls the others directly.
#pragma once

#include "common.h"

#include <optional>

namespace kiln {

// norm_rotary.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_into(at::Tensor& out, const at::Tensor& x, at::Tensor& residual,
                       const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& x);
void rotary_inplace(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                    int64_t head_dim);
void qk_norm_rotary_inplace(at::Tensor& qkv, const at::Tensor& positions,
                            const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                            int64_t num_kv_heads, int64_t head_dim);

// kv_cache.cpp
void write_kv_rows(const char* k, int64_t k_stride, const char* v, int64_t v_stride,
                   int64_t bytes, int64_t tokens, char* kc, char* vc, const int64_t* slot);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping);
void move_slots(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst);

// sampling.cpp
at::Tensor argmax_rows(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor> top_logprobs(const at::Tensor& logits, int64_t k,
                                                const at::Tensor& ids);

// paged_attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& tree_mask);

// prefill_attention.cpp
bool has_bf16_attention();
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, int64_t block_size, double scale);

// gemm.cpp
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w);
bool bf16_gemm_vectorized();
at::Tensor bf16_gemm_f32(const at::Tensor& x, const at::Tensor& w);
bool bf16_gemm_f32_dot_products();

// gemm_vnni.cpp: bf16 x [M, K] times VNNI-packed bf16 W [N/16, K/2, 16, 2] -> [M, n] in bf16
// (rounded once) or fp32; torch reference x.float() @ W.float().T
at::Tensor bf16_vnni_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, bool fp32_out);
bool bf16_vnni_available();
// the one-token GEMV's non-temporal prefetch distance in bytes (0: off); returns the previous
int64_t set_vnni_stream_ahead(int64_t bytes);

// gemm_int8_vnni.cpp: float x [M, K] times int8-VNNI-packed W (uint8 w + 128 [N/16, K/4, 16, 4])
// with per-row scales -> [M, n] in x's dtype or fp32; torch reference
// x.double() @ (w * scale).double().T (activations as 22-bit fixed point per token)
at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                        int64_t n, bool fp32_out);
bool int8_vnni_available();
int64_t int8_vnni_calls();
// from this many bf16 tokens on (0: never) int8_vnni_mm widens the codes to bf16 and runs the
// bf16 VNNI tiles, scale on the fp32 sums (reference x.float() @ w.float().T * scale); returns
// the previous value
int64_t set_int8_wide_min_tokens(int64_t tokens);

// moe.cpp: a MoE layer's routed experts in one call, on bf16 VNNI-packed, int8-VNNI-packed or
// int8 weight-only row experts stacked by expert;
// torch reference: kiln.models.layers.experts.FusedExperts's per-expert path
at::Tensor moe_experts_vnni(const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& owned);
at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& weights, const at::Tensor& gate_up,
                            const at::Tensor& gate_up_scale, const at::Tensor& down,
                            const at::Tensor& down_scale, const std::optional<at::Tensor>& owned);
at::Tensor moe_experts_int8_vnni(const at::Tensor& x, const at::Tensor& experts,
                                 const at::Tensor& weights, const at::Tensor& gate_up,
                                 const at::Tensor& gate_up_scale, const at::Tensor& down,
                                 const at::Tensor& down_scale,
                                 const std::optional<at::Tensor>& owned);

// router.cpp: a softmax router's top-k (weights fp32 [T, k], experts int64 [T, k]);
// torch reference: kiln.models.layers.moe.route (softmax, no groups, bias or scaling)
std::tuple<at::Tensor, at::Tensor> route_softmax(const at::Tensor& logits, int64_t top_k,
                                                 bool normalize);

// stack.cpp; q_norm/k_norm: empty where the model has no q/k norms; router[l] set: layer l is
// a sparse block whose stacked experts are gate_up_proj[l], down_proj[l];
// reduce_segment: tensor parallelism's shared-memory all-reduce (allreduce.h)
at::Tensor llama_stack(const at::Tensor& x_in, const at::Tensor& positions,
                       at::TensorList input_norm, at::TensorList qkv_proj,
                       at::TensorList o_proj, at::TensorList post_norm,
                       at::TensorList gate_up_proj, at::TensorList down_proj,
                       at::TensorList qkv_scale, at::TensorList o_scale,
                       at::TensorList gate_up_scale, at::TensorList down_scale,
                       at::TensorList q_norm, at::TensorList k_norm,
                       const c10::List<std::optional<at::Tensor>>& router,
                       const c10::List<std::optional<at::Tensor>>& expert_tokens,
                       int64_t top_k, bool normalize_top_k, const at::Tensor& final_norm, const at::Tensor& cos32,
                       const at::Tensor& sin32, at::TensorList k_caches,
                       at::TensorList v_caches, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& short_table,
                       const std::optional<at::Tensor>& short_start,
                       const std::optional<at::Tensor>& short_lens,
                       const std::optional<at::Tensor>& short_context,
                       const std::optional<at::Tensor>& short_tree,
                       const std::optional<at::Tensor>& long_table,
                       const std::optional<at::Tensor>& long_start,
                       const std::optional<at::Tensor>& long_lens,
                       const std::optional<at::Tensor>& long_context, int64_t block_size,
                       double scale, double eps, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, bool plain_bf16,
                       const std::optional<at::Tensor>& reduce_segment, int64_t reduce_rank,
                       double reduce_timeout_s);

}  // namespace kiln
