// The whole decoder stack of a Llama-family model in one call.
//
// The same ops, in the same order and with the same roundings, as LlamaDecoderLayer.forward on
// kiln's fast path (fused norms, packed bf16 linears, in-place rotary, the cpu attention
// backend), for every layer, without returning to Python in between: at batch 1 the ~20
// Python-level calls per layer cost more than the layer's norms, rotary and attention
// together. Linears are kiln's VNNI-packed bf16, oneDNN bf16, or kiln's int8 GEMV or bf16_gemm
// (both on decode-sized steps). Qwen3's per-head q/k RMS norms run through the per-layer
// path's kernel (qk_norm_rotary_inplace). A layer's feed-forward is a dense SwiGLU MLP or a
// softmax-routed mixture of bf16 or int8 VNNI-packed experts (Qwen3-MoE's sparse block): the
// router through the ops the Python block calls, in its order, then the fused expert kernel
// (moe.cpp). Used only where the model has no hooks or biases (kiln.runner.fused_stack
// decides); its result is bit-identical to the per-layer path, which the tests check.
//
// Tensor parallelism: each rank runs the stack on its own heads and columns (its qkv and
// gate_up rows, its o_proj and down_proj columns) and, given a shared-memory all-reduce
// segment, sums the row-parallel o_proj and down_proj outputs over the ranks right after
// each (kiln::shm_all_reduce, allreduce.cpp: the call RowParallel makes on the per-layer path,
// on the same tensor, so the same bits). Ranks share the segment's step counters whichever
// path calls it, so one rank may run the stack while another runs the layers one call each.
// A rank that does not arrive makes the wait raise after its timeout, out of this call.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>

#include "allreduce.h"
#include "ops.h"

namespace kiln {

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        c10::string_view, c10::List<std::optional<at::Scalar>>,
                        std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// Layer l of one projection: int8 weights with per-row scales through int8_gemv where the
// layer has a scale, else bf16 weights: VNNI-packed ones (4-D) through bf16_vnni_mm, plain
// ones through bf16_gemm (fp32 arithmetic, CPUs without bf16 instructions) where plain_bf16,
// oneDNN-prepacked ones otherwise.
at::Tensor stack_linear(const at::Tensor& x, at::TensorList weights, at::TensorList scales,
                        int64_t l, bool plain_bf16) {
  const bool int8 = !scales.empty() && scales[l].numel() > 0;
  if (int8 && weights[l].dim() == 4)  // int8 VNNI-packed (gemm_int8_vnni.cpp)
    return int8_vnni_mm(x, weights[l], scales[l], scales[l].numel(), false);
  if (int8) return int8_gemv(x, weights[l], scales[l]);
  if (weights[l].dim() == 4) return bf16_vnni_mm(x, weights[l], weights[l].size(0) * 16, false);
  if (plain_bf16) return bf16_gemm(x, weights[l]);
  return onednn_linear(x, weights[l]);
}

// A row-parallel projection's partial output summed over the ranks in place; unchanged
// without a segment (one rank).
at::Tensor reduced(at::Tensor partial, const std::optional<at::Tensor>& segment, int64_t rank,
                   double timeout_s) {
  if (segment.has_value()) {
    at::Tensor shared = *segment;
    shm_all_reduce(partial, shared, rank, timeout_s);
  }
  return partial;
}

// A softmax-routed sparse block's output for h [T, H], as kiln.models.layers.moe's
// SparseMoeBlock computes it without a shared expert: logits in the router's dtype (on kiln's
// VNNI kernel where the router is VNNI-packed, 4-D, as Router.forward), the top k of their
// softmax by route_softmax (router.cpp, Router.forward's op), the routed pairs counted, the
// experts through the fused kernel for their format (bf16 VNNI-packed, or int8 VNNI-packed
// with per-row scales) (the same ops in the same order: the same bits).
at::Tensor sparse_block(const at::Tensor& h, const at::Tensor& router, at::Tensor counts,
                        const at::Tensor& gate_up, const at::Tensor& down,
                        const at::Tensor& gate_up_scale, const at::Tensor& down_scale,
                        int64_t top_k, bool normalize_top_k) {
  const at::Tensor logits = router.dim() == 4
      ? bf16_vnni_mm(h, router, counts.size(0), false)
      : at::linear(h.to(router.scalar_type()), router);  // [T, E]
  const auto [weights, experts] = route_softmax(logits, top_k, normalize_top_k);
  int64_t* count = counts.data_ptr<int64_t>();  // SparseMoeBlock.count's index_add_
  const int64_t* id = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts.numel(); ++i) ++count[id[i]];
  if (gate_up.scalar_type() == at::kByte)
    return moe_experts_int8_vnni(h, experts, weights, gate_up, gate_up_scale, down, down_scale,
                                 std::nullopt);
  return moe_experts_vnni(h, experts, weights, gate_up, down, std::nullopt);
}

}  // namespace

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
                       double reduce_timeout_s) {
  TORCH_CHECK(!reduce_segment.has_value() || reduce_timeout_s > 0, "llama_stack: an all-reduce ",
              "needs a positive timeout, got ", reduce_timeout_s);
  const int64_t layers = static_cast<int64_t>(qkv_proj.size());
  const int64_t tokens = x_in.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in, residual;
  const at::Tensor slots = slot_mapping.contiguous().to(at::kLong);
  const int64_t* slot = slots.data_ptr<int64_t>();
  // every norm's output, layer after layer (each is read by the GEMV right after it)
  at::Tensor h = at::empty_like(x_in, at::MemoryFormat::Contiguous);
  for (int64_t l = 0; l < layers; ++l) {
    if (l == 0) {
      residual = x;
      rms_norm_into(h, x, input_norm[l], eps);
    } else {
      add_rms_norm_into(h, x, residual, input_norm[l], eps);
    }
    at::Tensor qkv = stack_linear(h, qkv_proj, qkv_scale, l, plain_bf16);
    if (q_norm.empty())
      rotary_inplace(qkv, positions, cos32, sin32, num_heads, num_kv_heads, head_dim);
    else
      qk_norm_rotary_inplace(qkv, positions, q_norm[l], k_norm[l], eps, cos32, sin32,
                             num_heads, num_kv_heads, head_dim);
    // q as one strided view; k and v copied to their slots straight from qkv's columns (no
    // views per layer: each reaches cold memory after the weights' stream)
    const at::Tensor q = qkv.as_strided({tokens, num_heads, head_dim},
                                        {qkv.stride(0), head_dim, 1});
    const at::Tensor& k_cache = k_caches[l];
    const at::Tensor& v_cache = v_caches[l];
    const int64_t es = qkv.element_size(), row = qkv.stride(0) * es;
    const auto* k = static_cast<const char*>(qkv.data_ptr()) + q_size * es;
    write_kv_rows(k, row, k + kv_size * es, row, kv_size * es, tokens,
                  static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
                  slot);
    at::Tensor attn = at::empty({tokens, q_size}, qkv.options());
    if (short_table.has_value())
      paged_attention(attn, q, k_cache, v_cache, *short_table, *short_start, *short_lens,
                      *short_context, block_size, scale, short_tree);
    if (long_table.has_value())
      prefill_attention(attn, q, k_cache, v_cache, *long_table, *long_start, *long_lens,
                        *long_context, block_size, scale);
    const at::Tensor o = reduced(stack_linear(attn, o_proj, o_scale, l, plain_bf16),
                                 reduce_segment, reduce_rank, reduce_timeout_s);
    add_rms_norm_into(h, o, residual, post_norm[l], eps);
    const std::optional<at::Tensor> gate = router.get(l);
    if (gate.has_value())  // gate_up_proj[l], down_proj[l]: the layer's stacked experts
      x = sparse_block(h, *gate, *expert_tokens.get(l), gate_up_proj[l], down_proj[l],
                       gate_up_scale.empty() ? at::Tensor() : gate_up_scale[l],
                       down_scale.empty() ? at::Tensor() : down_scale[l], top_k,
                       normalize_top_k);
    else
      x = reduced(stack_linear(silu_mul(stack_linear(h, gate_up_proj, gate_up_scale, l,
                                                     plain_bf16)),
                               down_proj, down_scale, l, plain_bf16),
                  reduce_segment, reduce_rank, reduce_timeout_s);
  }
  return add_rms_norm(x, residual, final_norm, eps);
}

}  // namespace kiln
