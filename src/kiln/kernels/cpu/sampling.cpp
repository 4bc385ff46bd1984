// Sampling-side kernels: each logits row's argmax, and its top-k log-probabilities.

#include "ops.h"

namespace kiln {

namespace {

// argmax_row over x[i, n) given the best of x[0, i): a NaN ends the search at its index.
int64_t argmax_tail(const float* x, int64_t i, int64_t n, float best, int64_t best_at) {
  for (; i < n; ++i) {
    const float v = x[i];
    if (v != v) return i;
    if (v > best) best = v, best_at = i;
  }
  return best_at;
}

// The first index of the largest value of x[0, n), or of the first NaN (torch.argmax's answer:
// NaN ranks above everything). 16 lanes each keep their first maximum; among lanes holding
// the row's maximum the lowest index wins, so equals resolve to the first as in torch.
int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i lane = at;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n && !nan; i += 16) {
      lane = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 up = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);  // strictly: first stays
      top = _mm512_mask_mov_ps(top, up, v);
      at = _mm512_mask_mov_epi32(at, up, lane);
    }
    if (nan) return x[0] != x[0] ? 0 : argmax_tail(x, 1, n, x[0], 0);  // rare: the NaN rule
    const float best = _mm512_reduce_max_ps(top);
    const __mmask16 holds = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    return argmax_tail(x, i, n, best, _mm512_mask_reduce_min_epi32(holds, at));
  }
#endif
  return x[0] != x[0] ? 0 : argmax_tail(x, 1, n, x[0], 0);
}

}  // namespace

// [R] int64: the argmax of each row of fp32 logits [R, V] (torch.argmax(dim=-1)'s answer,
// ties and NaN included), in one pass at vector width: torch's reduction takes ~40 us for
// a 49,152-entry row, a greedy decode step's whole sampling.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "argmax_rows: fp32 logits [R, V] expected");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows must not be empty");
  auto lc = logits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  auto out = at::empty({rows}, lc.options().dtype(at::kLong));
  const float* x = lc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * vocab, vocab);
  });
  return out;
}

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
