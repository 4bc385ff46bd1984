// Registers the kernels of this directory as torch.ops.kiln.*: the one TORCH_LIBRARY block, so
// the op set and its schemas read in one place. Each op's torch reference is named in the
// header of the file that defines it; kiln/kernels/cpu/__init__.py builds and loads them.
#include <torch/library.h>

#include "allreduce.h"
#include "ops.h"

TORCH_LIBRARY(kiln, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &kiln::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &kiln::add_rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor", &kiln::silu_mul);
  m.def("rotary_inplace(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "int num_q_heads, int num_kv_heads, int head_dim) -> ()", &kiln::rotary_inplace);
  m.def("qk_norm_rotary_inplace(Tensor(a!) qkv, Tensor positions, Tensor q_weight, "
        "Tensor k_weight, float eps, Tensor cos, Tensor sin, int num_q_heads, "
        "int num_kv_heads, int head_dim) -> ()", &kiln::qk_norm_rotary_inplace);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()", &kiln::write_kv);
  m.def("move_slots(Tensor(a!)[] caches, Tensor src, Tensor dst) -> ()", &kiln::move_slots);
  m.def("argmax_rows(Tensor logits) -> Tensor", &kiln::argmax_rows);
  m.def("top_logprobs(Tensor logits, int k, Tensor ids) -> (Tensor, Tensor)",
        &kiln::top_logprobs);
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale, Tensor? tree_mask=None) -> ()", &kiln::paged_attention);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale) -> ()", &kiln::prefill_attention);
  m.def("has_bf16_attention() -> bool", &kiln::has_bf16_attention);
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor", &kiln::int8_gemv);
  m.def("bf16_gemm(Tensor x, Tensor w) -> Tensor", &kiln::bf16_gemm);
  m.def("bf16_gemm_vectorized() -> bool", &kiln::bf16_gemm_vectorized);
  m.def("bf16_gemm_f32(Tensor x, Tensor w) -> Tensor", &kiln::bf16_gemm_f32);
  m.def("bf16_gemm_f32_dot_products() -> bool", &kiln::bf16_gemm_f32_dot_products);
  m.def("bf16_vnni_mm(Tensor x, Tensor w, int n, bool fp32_out) -> Tensor", &kiln::bf16_vnni_mm);
  m.def("bf16_vnni_available() -> bool", &kiln::bf16_vnni_available);
  m.def("set_vnni_stream_ahead(int bytes) -> int", &kiln::set_vnni_stream_ahead);
  m.def("set_int8_wide_min_tokens(int tokens) -> int", &kiln::set_int8_wide_min_tokens);
  m.def("moe_experts_vnni(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, "
        "Tensor down, Tensor? owned=None) -> Tensor", &kiln::moe_experts_vnni);
  m.def("moe_experts_int8(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, "
        "Tensor gate_up_scale, Tensor down, Tensor down_scale, Tensor? owned=None) -> Tensor",
        &kiln::moe_experts_int8);
  m.def("moe_experts_int8_vnni(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, "
        "Tensor gate_up_scale, Tensor down, Tensor down_scale, Tensor? owned=None) -> Tensor",
        &kiln::moe_experts_int8_vnni);
  m.def("route_softmax(Tensor logits, int top_k, bool normalize) -> (Tensor, Tensor)",
        &kiln::route_softmax);
  m.def("llama_stack(Tensor x, Tensor positions, Tensor[] input_norm, Tensor[] qkv_proj, "
        "Tensor[] o_proj, Tensor[] post_norm, Tensor[] gate_up_proj, Tensor[] down_proj, "
        "Tensor[] qkv_scale, Tensor[] o_scale, Tensor[] gate_up_scale, Tensor[] down_scale, "
        "Tensor[] q_norm, Tensor[] k_norm, Tensor?[] router, Tensor?[] expert_tokens, "
        "int top_k, bool normalize_top_k, Tensor final_norm, Tensor cos32, Tensor sin32, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor slot_mapping, Tensor? short_table, Tensor? short_start, Tensor? short_lens, "
        "Tensor? short_context, Tensor? short_tree, Tensor? long_table, Tensor? long_start, "
        "Tensor? long_lens, Tensor? long_context, int block_size, float scale, float eps, "
        "int num_heads, int num_kv_heads, int head_dim, bool plain_bf16, "
        "Tensor(c!)? reduce_segment=None, int reduce_rank=0, float reduce_timeout_s=0.) -> Tensor",
        &kiln::llama_stack);
  m.def("shm_segment_bytes(int world_size, int chunk_bytes) -> int", &kiln::shm_segment_bytes);
  m.def("shm_segment_init(Tensor(a!) segment, int world_size, int chunk_bytes) -> ()",
        &kiln::shm_segment_init);
  m.def("shm_segment_join(Tensor(a!) segment, int rank, int world_size, int chunk_bytes, "
        "float timeout_s) -> ()", &kiln::shm_segment_join);
  m.def("shm_all_reduce(Tensor(a!) x, Tensor(b!) segment, int rank, float timeout_s) -> ()",
        &kiln::shm_all_reduce);
  m.def("shm_all_to_all(Tensor send, int[] send_bytes, Tensor(a!) recv, int[] recv_bytes, "
        "Tensor(b!) segment, int rank, float timeout_s) -> ()", &kiln::shm_all_to_all);
  m.def("int8_vnni_mm(Tensor x, Tensor w, Tensor scale, int n, bool fp32_out) -> Tensor",
        &kiln::int8_vnni_mm);
  m.def("int8_vnni_available() -> bool", &kiln::int8_vnni_available);
  m.def("int8_vnni_calls() -> int", &kiln::int8_vnni_calls);
}
