// A softmax router's top-k choice for a step's tokens, one small loop per token instead of
// the half-dozen ATen ops (softmax, topk, gather, sum, div) a layer's router otherwise pays
// dispatch and allocation for at every decode step (~20 us a layer on a 2-core Zen 4).
//
//   scores[t] = softmax(logits[t])                     (fp32: e^(x - max) / their sum)
//   experts[t] = the k best scores, best first; a tie goes to the lower expert id
//   weights[t] = scores[t, experts[t]], divided by (their sum + 1e-20) where `normalize`
//
// Torch reference: kiln.models.layers.moe.route for a softmax spec without groups, bias or
// scaling (the same choice; the weights equal to fp32 rounding: the exponentials and sums
// here are kiln's, not ATen's vectorized ones). Both the per-layer Router and the fused
// decoder stack call this op, so the two paths route alike to the bit.
#include "ops.h"

namespace kiln {

std::tuple<at::Tensor, at::Tensor> route_softmax(const at::Tensor& logits, int64_t top_k,
                                                 bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(),
              "route_softmax: logits must be a CPU [T, E] tensor");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "route_softmax: top_k ", top_k, " of ", E, " experts");
  const at::Tensor x = logits.to(at::kFloat).contiguous();
  at::Tensor weights = at::empty({T, top_k}, x.options());
  at::Tensor experts = at::empty({T, top_k}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  int64_t* ids = experts.data_ptr<int64_t>();
  std::vector<float> e(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * E;
    const float peak = *std::max_element(row, row + E);
    exp_shifted(row, e.data(), E, peak);
    float sum = 0.f;
    for (int64_t i = 0; i < E; ++i) sum += e[i];
    for (int64_t i = 0; i < E; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      ids[t * top_k + j] = order[j];
      w[t * top_k + j] = e[order[j]] / sum;
      chosen += w[t * top_k + j];
    }
    if (normalize)
      for (int64_t j = 0; j < top_k; ++j) w[t * top_k + j] /= chosen + 1e-20f;
  }
  return {weights, experts};
}

}  // namespace kiln
