// Sampling-side kernels: the top-k log-probabilities of each logits row.

#include "ops.h"

namespace kiln {

// Per row of logits [R, V]: the k largest, best first (the lower index first among equals),
// as log-probabilities (fp32, over the row's softmax) and as ids[index] (int64): a speculator's
// likeliest drafts in one call instead of widen, log_softmax, topk and an index.
std::tuple<at::Tensor, at::Tensor> top_logprobs(const at::Tensor& logits, int64_t k,
                                                const at::Tensor& ids) {
  TORCH_CHECK(logits.dim() == 2, "top_logprobs: logits [R, V] expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(0 < k && k <= vocab, "top_logprobs: k must be in 1..V");
  TORCH_CHECK(ids.numel() == vocab, "top_logprobs: one id per logit column expected");
  auto lc = logits.contiguous();
  auto idc = ids.to(at::kLong).contiguous();
  auto values = at::empty({rows, k}, lc.options().dtype(at::kFloat));
  auto index = at::empty({rows, k}, idc.options());
  const int64_t* id = idc.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lc.scalar_type(), "top_logprobs", [&] {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> x(vocab), e(vocab), best(k);
      std::vector<int64_t> at_(k);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = lc.data_ptr<scalar_t>() + r * vocab;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < vocab; ++i) top = std::max(top, x[i] = f32(row[i]));
        exp_shifted(x.data(), e.data(), vocab, top);
        double sum = 0;
        for (int64_t i = 0; i < vocab; ++i) sum += e[i];
        const float lse = top + static_cast<float>(std::log(sum));
        int64_t have = 0;
        for (int64_t i = 0; i < vocab; ++i) {
          const float v = x[i];
          if (have == k && !(v > best[k - 1])) continue;
          int64_t j = have < k ? have++ : k - 1;
          for (; j > 0 && v > best[j - 1]; --j) best[j] = best[j - 1], at_[j] = at_[j - 1];
          best[j] = v, at_[j] = i;
        }
        float* vo = values.data_ptr<float>() + r * k;
        int64_t* io = index.data_ptr<int64_t>() + r * k;
        for (int64_t j = 0; j < k; ++j) vo[j] = best[j] - lse, io[j] = id[at_[j]];
      }
    });
  });
  return {values, index};
}

}  // namespace kiln
