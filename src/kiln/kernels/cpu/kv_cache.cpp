// Paged KV cache writes: a step's keys and values into their slots, and slot-to-slot moves
// (an accepted draft path's KV). Torch reference: kiln/runner/attention.py, kv_cache.py.

#include "ops.h"

namespace kiln {

// kc[slot[t]] = k[t], vc[slot[t]] = v[t] for t < tokens: rows of `bytes` bytes, token t's k
// row `k_stride` bytes after token t - 1's, its v row `v_stride` (any dtype: a byte copy).
// From KV_WRITE_SPLIT tokens on, the threads share the rows: each write lands in a cold line
// (the cache was last touched a step ago), so the copies wait on memory, and two threads keep
// twice as many of those misses in flight.
constexpr int64_t KV_WRITE_SPLIT = 16;

void write_kv_rows(const char* k, int64_t k_stride, const char* v, int64_t v_stride,
                   int64_t bytes, int64_t tokens, char* kc, char* vc, const int64_t* slot) {
  const auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * bytes, k + t * k_stride, bytes);
      std::memcpy(vc + slot[t] * bytes, v + t * v_stride, bytes);
    }
  };
  if (tokens < KV_WRITE_SPLIT) return rows(0, tokens);
  at::parallel_for(0, tokens, KV_WRITE_SPLIT / 2, rows);
}

// k_cache[slot[t]] = k[t]; v_cache[slot[t]] = v[t]. k, v: [T, Hkv, D] (row-strided views ok).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "k heads must be packed");
  TORCH_CHECK(v.stride(2) == 1 && v.stride(1) == v.size(2), "v heads must be packed");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "write_kv: k, v and the caches must share a dtype");
  auto slots = slot_mapping.contiguous().to(at::kLong);
  const int64_t es = k.element_size();
  write_kv_rows(static_cast<const char*>(k.data_ptr()), k.stride(0) * es,
                static_cast<const char*>(v.data_ptr()), v.stride(0) * es,
                k.size(1) * k.size(2) * es, k.size(0), static_cast<char*>(k_cache.data_ptr()),
                static_cast<char*>(v_cache.data_ptr()), slots.data_ptr<int64_t>());
}

// caches[i][dst[j]] = caches[i][src[j]] for every cache (any shape [slots, ...], contiguous)
// and slot pair, the source rows gathered before any is written: an accepted tree path's KV
// moved to its positions in every layer in one call (from Python, two index ops per layer).
void move_slots(at::TensorList caches, const at::Tensor& src,
                const at::Tensor& dst) {
  TORCH_CHECK(src.numel() == dst.numel(), "move_slots: src and dst must pair up");
  auto s = src.contiguous().to(at::kLong), d = dst.contiguous().to(at::kLong);
  const int64_t n = s.numel(), *sp = s.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  std::vector<char> rows;
  for (const auto& cache : caches) {
    TORCH_CHECK(cache.is_contiguous() && cache.dim() >= 1, "move_slots: contiguous caches");
    const int64_t slots = cache.size(0), row = cache.numel() / std::max<int64_t>(slots, 1) *
                                                   cache.element_size();
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(0 <= sp[j] && sp[j] < slots && 0 <= dp[j] && dp[j] < slots,
                  "move_slots: slot out of range");
    char* base = static_cast<char*>(cache.data_ptr());
    rows.resize(n * row);
    for (int64_t j = 0; j < n; ++j) std::memcpy(rows.data() + j * row, base + sp[j] * row, row);
    for (int64_t j = 0; j < n; ++j) std::memcpy(base + dp[j] * row, rows.data() + j * row, row);
  }
}

}  // namespace kiln
