// kiln CPU kernels: fused elementwise ops, paged attention for short queries, an int8
// weight-only matmul for decode-sized token counts and a bf16-weight matmul for CPUs without
// bf16 arithmetic.
//
// Each op has a plain torch reference in kiln/models/layers/ops.py, kiln/runner/attention.py or
// kiln/quant/linear.py that the tests compare it with. Math is done in fp32 and rounded once to the tensor dtype.
// Built on first use with torch.utils.cpp_extension (see kiln/runner/cpu_ops/__init__.py).

#include <ATen/Parallel.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// e^x for 16 lanes: 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2, 2^f by its Taylor series to
// degree 7 (relative error < 2e-7), 2^n applied exactly with scalef.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);  // e^g with g = f ln 2, Horner
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// out[i] = e^(in[i] - shift) over n floats
inline void exp_shifted(const float* in, float* out, int64_t n, float shift) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, exp512(_mm512_sub_ps(_mm512_loadu_ps(in + i), sh)));
#endif
  for (; i < n; ++i) out[i] = std::exp(in[i] - shift);
}

// out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)); optionally residual += x first.
template <typename T>
void rms_rows(T* out, T* x, T* residual, const T* w, int64_t rows, int64_t dim,
              int64_t x_stride, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          T sum = static_cast<T>(f32(rr[i]) + f32(xr[i]));  // the residual add rounds to T
          rr[i] = sum;
          buf[i] = f32(sum);
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) buf[i] = f32(xr[i]);
      }
      for (int64_t i = 0; i < dim; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        T normed = static_cast<T>(buf[i] * inv);
        o[i] = static_cast<T>(f32(w[i]) * f32(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), nullptr,
                       weight.data_ptr<scalar_t>(), rows, dim, dim, eps);
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  auto xc = x.contiguous();
  auto out = at::empty_like(residual);
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms", [&] {
    rms_rows<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                       residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, dim,
                       dim, eps);
  });
  return out;
}

// out[t, :I] = silu(x[t, :I]) * x[t, I:]
at::Tensor silu_mul(const at::Tensor& x) {
  auto xc = x.contiguous();
  const int64_t two_i = xc.size(-1), inner = two_i / 2, rows = xc.numel() / two_i;
  auto sizes = xc.sizes().vec();
  sizes.back() = inner;
  auto out = at::empty(sizes, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * two_i;
        const scalar_t* u = g + inner;
        scalar_t* orow = o + r * inner;
        float gate[256], negated[256];
        for (int64_t i0 = 0; i0 < inner; i0 += 256) {  // silu(g) = g / (1 + e^-g), in fp32
          const int64_t n = std::min<int64_t>(256, inner - i0);
          for (int64_t i = 0; i < n; ++i) negated[i] = -f32(g[i0 + i]);
          exp_shifted(negated, gate, n, 0.f);
          for (int64_t i = 0; i < n; ++i)
            orow[i0 + i] = static_cast<scalar_t>(-negated[i] / (1.f + gate[i]) * f32(u[i0 + i]));
        }
      }
    });
  });
  return out;
}

// In place on qkv [T, (Hq + 2 Hkv) * D]: rotate the q and k heads (rotate-half layout).
// cos/sin: [max_pos, D] fp32 tables (both halves duplicated, as HF builds them).
void rotary_inplace(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                    int64_t head_dim) {
  TORCH_CHECK(qkv.stride(-1) == 1, "qkv rows must be contiguous");
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t heads = num_q_heads + num_kv_heads;
  auto pos = positions.contiguous().to(at::kLong);
  auto c = cos.contiguous().to(at::kFloat);
  auto s = sin.contiguous().to(at::kFloat);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / heads, h = job % heads;
        scalar_t* v = base + t * row_stride + h * head_dim;
        const float* cr = cp + p[t] * head_dim;
        const float* sr = sp + p[t] * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]);
          v[i] = static_cast<scalar_t>(x1 * cr[i] - x2 * sr[i]);
          v[i + half] = static_cast<scalar_t>(x2 * cr[i + half] + x1 * sr[i + half]);
        }
      }
    });
  });
}

// k_cache[slot[t]] = k[t]; v_cache[slot[t]] = v[t]. k, v: [T, Hkv, D] (row-strided views ok).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "k heads must be packed");
  TORCH_CHECK(v.stride(2) == 1 && v.stride(1) == v.size(2), "v heads must be packed");
  auto slots = slot_mapping.contiguous().to(at::kLong);
  const int64_t* sl = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy_n(kp + t * k.stride(0), width, kc + sl[t] * width);
      std::copy_n(vp + t * v.stride(0), width, vc + sl[t] * width);
    }
  });
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

// Vector helpers: fp32 dot and axpy against a row stored in T (bf16, fp16 or fp32).
// AVX-512 when the head dim is a multiple of 16, a scalar loop otherwise.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; x += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + x), load16(k + x), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t x = 0; x < d; ++x) acc += q[x] * f32(k[x]);
  return acc;
}

template <typename T>
inline void axpy_row(float* a, float w, const T* v, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) if (d % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t x = 0; x < d; x += 16)
      _mm512_storeu_ps(a + x, _mm512_fmadd_ps(wv, load16(v + x), _mm512_loadu_ps(a + x)));
    return;
  }
#endif
  for (int64_t x = 0; x < d; ++x) a[x] += w * f32(v[x]);
}

#if defined(__AVX512F__)
// Load one byte of every cache line of a sequence's K and V rows (`row` elements per slot, all
// heads) before computing on them. The loads are independent, so the core keeps many misses in
// flight; inside the compute loops each line's miss waits behind the work on the line before.
// Measured at batch 64, 150-token contexts, from DRAM: 1.32 -> 0.70 ms per layer; software
// prefetch hints to the same lines changed nothing on this CPU.
template <typename T>
inline void touch_rows(const T* kc, const T* vc, const int64_t* table, int64_t nk, int64_t row,
                       int64_t block_size) {
  int sink = 0;
  const int64_t line = 64, row_bytes = row * static_cast<int64_t>(sizeof(T));
  for (int64_t j0 = 0; j0 < nk; j0 += block_size) {
    const int64_t offset = table[j0 / block_size] * block_size * row_bytes;
    const int64_t bytes = std::min(block_size, nk - j0) * row_bytes;
    const auto* k = reinterpret_cast<const char*>(kc) + offset;
    const auto* v = reinterpret_cast<const char*>(vc) + offset;
    for (int64_t b = 0; b < bytes; b += line) sink += k[b] + v[b];
  }
  asm volatile("" : : "r"(sink));  // keeps the loads from being optimized away
}

#endif

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Lane i of the result = the sum of a[i]'s 16 lanes (three rounds of pairwise interleaved adds).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[r, 16 chunk + i] = scale * (q[r] . K[i]) for bf16 rows q [rows, D] and n <= 16 keys
// whose rows start at `keys`, `stride` elements apart: each key row is read contiguously,
// multiplied pairwise with vdpbf16ps (exact products, fp32 sums), and the 16 keys' partial
// sums are reduced together.
template <int D>
inline void score_keys(const uint16_t* q, int64_t rows, const at::BFloat16* keys,
                       int64_t stride, int64_t n, float* scores, int64_t ld, __m512 scale) {
  constexpr int C = D / 32;
  for (int64_t r = 0; r < rows; ++r) {
    __m512i qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(q + r * D + c * 32);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = _mm512_setzero_ps();
      if (i < n)
        for (int c = 0; c < C; ++c)
          a[i] = _mm512_dpbf16_ps(a[i], as_bh(qv[c]),
                                  as_bh(_mm512_loadu_si512(keys + i * stride + c * 32)));
    }
    _mm512_mask_storeu_ps(scores + r * ld, static_cast<__mmask16>((1u << n) - 1),
                          _mm512_mul_ps(reduce16(a), scale));
  }
}
#endif

// scores[r, j] = qf[r] . K[j] for every row r and key j of one kv head.
// For bf16 caches with AVX-512, 16 keys of one block at a time: each gather fetches a pair
// of adjacent bf16 values from 16 key rows, so the keys sit in the lanes and the rows
// accumulate with broadcast-FMAs, with no horizontal reductions.
template <typename T>
void key_scores(const float* qf, const T* kc, const int64_t* table, float* scores,
                int64_t rows, int64_t nk, int64_t kvh, int64_t hkv, int64_t d,
                int64_t block_size) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d % 2 == 0 && rows <= 32) {
      const int64_t stride = hkv * d;  // elements between consecutive slots' rows
      const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                              6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(stride)));
      const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      __m512 acc[32];
      for (int64_t j0 = 0; j0 < nk;) {
        const int64_t in_block = block_size - j0 % block_size;
        const int64_t n = std::min<int64_t>({16, in_block, nk - j0});
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
        const T* base = kc + slot * stride + kvh * d;
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x += 2) {
          const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx,
                                                           base + x, 2);
          const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
          const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(pair, hi_mask));
          for (int64_t r = 0; r < rows; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + x]), lo, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + x + 1]), hi, acc[r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(scores + r * nk + j0, mask, acc[r]);
        j0 += n;
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const T* krow = kc + (slot * hkv + kvh) * d;
    for (int64_t r = 0; r < rows; ++r) scores[r * nk + j] = dot_row(qf + r * d, krow, d);
  }
}

// acc[r] = sum_j p[r, j] V[j] for every row r of one kv head. With AVX-512, fp32 accumulators
// for up to 4 rows of a 64- or 128-wide head stay in registers across all keys.
#if defined(__AVX512F__)
template <int ROWS, int CHUNKS, typename T>
void weighted_values_regs(const float* p, const T* vc, const int64_t* table, float* acc,
                          int64_t nk, int64_t kvh, int64_t hkv, int64_t block_size) {
  constexpr int64_t d = CHUNKS * 16;
  __m512 a[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < nk;) {
    const int64_t n = std::min<int64_t>({16, block_size - j0 % block_size, nk - j0});
    const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
    const T* base = vc + (slot * hkv + kvh) * d;
    for (int64_t i = 0; i < n; ++i) {
      const T* vrow = base + i * hkv * d;
      __m512 v[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) v[c] = load16(vrow + c * 16);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 w = _mm512_set1_ps(p[r * nk + j0 + i]);
        for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
      }
    }
    j0 += n;
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + r * d + c * 16, a[r][c]);
}

template <int CHUNKS, typename T>
void weighted_values_rows(const float* p, const T* vc, const int64_t* table, float* acc,
                          int64_t rows, int64_t nk, int64_t kvh, int64_t hkv,
                          int64_t block_size) {
  constexpr int64_t d = CHUNKS * 16;
  int64_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4)
    weighted_values_regs<4, CHUNKS>(p + r0 * nk, vc, table, acc + r0 * d, nk, kvh, hkv, block_size);
  const float* pr = p + r0 * nk;
  float* ar = acc + r0 * d;
  switch (rows - r0) {  // the rest in one pass over the values
    case 3: weighted_values_regs<3, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    case 2: weighted_values_regs<2, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    case 1: weighted_values_regs<1, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    default: break;
  }
}
#endif

template <typename T>
void weighted_values(const float* p, const T* vc, const int64_t* table, float* acc,
                     int64_t rows, int64_t nk, int64_t kvh, int64_t hkv, int64_t d,
                     int64_t block_size) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (d == 64 || d == 128) {
      if (d == 64) weighted_values_rows<4>(p, vc, table, acc, rows, nk, kvh, hkv, block_size);
      else weighted_values_rows<8>(p, vc, table, acc, rows, nk, kvh, hkv, block_size);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const T* vrow = vc + (slot * hkv + kvh) * d;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = p[r * nk + j];
      if (w != 0.f) axpy_row(acc + r * d, w, vrow, d);
    }
  }
}

inline void softmax_row(float* s, int64_t n) {
  const float mx = *std::max_element(s, s + n);
  exp_shifted(s, s, n, mx);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += s[j];
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// Paged attention for sequences with short queries (decodes, draft verification).
// q: [T, Hq, D] (row-strided view ok); caches: [slots, Hkv, D]; out: [T, Hq * D].
// Sequence s owns flat tokens [query_start[s], query_start[s] + query_lens[s]); token i sits at
// position context_lens[s] + i and attends to keys at positions <= its own. With `tree` (one
// int64 per flat token, or null), a token whose entry m is nonzero attends instead, among its
// sequence's query tokens, to those j with bit j of m set (a draft tree: its ancestors and
// itself), and to every context key as before.
// One task per (sequence, kv head): the group's query heads share each K/V row read.
// Mask the scores of query tokens [t0, t0 + nq) against their own block's keys ctx + 1 .. :
// causal, or by each token's tree bits (see paged_attention). rows = nq * group, row stride nk.
// The tokens are the sequence's query tokens i0 .. i0 + nq - 1 (a job may take part of them).
inline void mask_query_block(float* scores, const int64_t* tree, int64_t t0, int64_t nq,
                             int64_t ctx, int64_t nk, int64_t group, int64_t i0 = 0) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t m = tree ? tree[t0 + i] : 0;
    for (int64_t j = ctx + 1; j < nk; ++j) {
      const bool visible = m ? ((m >> (j - ctx)) & 1) != 0 : j - ctx <= i0 + i;
      if (!visible)
        for (int64_t g = 0; g < group; ++g) scores[(i * group + g) * nk + j] = neg_inf;
    }
  }
}

template <typename T>
void attend_one(const T* qp, const T* kc, const T* vc, T* op, const int64_t* table,
                int64_t t0, int64_t nq, int64_t ctx, int64_t kvh, int64_t hkv, int64_t group,
                int64_t d, int64_t q_row, int64_t q_head, int64_t block_size, float scale,
                const int64_t* tree, std::vector<float>& qf, std::vector<float>& scores,
                std::vector<float>& acc) {
  const int64_t nk = ctx + nq, rows = nq * group, hq = hkv * group;
  scores.resize(rows * nk);
  qf.resize(rows * d);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = qp + (t0 + i) * q_row + (kvh * group + g) * q_head;
      float* dst = qf.data() + (i * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = f32(src[x]) * scale;
    }
  key_scores(qf.data(), kc, table, scores.data(), rows, nk, kvh, hkv, d, block_size);
  mask_query_block(scores.data(), tree, t0, nq, ctx, nk, group);
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * nk, nk);
  acc.assign(rows * d, 0.f);
  weighted_values(scores.data(), vc, table, acc.data(), rows, nk, kvh, hkv, d, block_size);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      T* dst = op + (t0 + i) * (hq * d) + (kvh * group + g) * d;
      const float* a = acc.data() + (i * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(a[x]);
    }
}

#if defined(__AVX512BF16__)
// softmax over n floats in place, 16 lanes at a time: max, e^(x - max), sum, scale
inline void softmax_row16(float* s, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 m = ninf;
  for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  if (tail) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, tail, s + full));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, tail, s + full), mx));
    _mm512_mask_storeu_ps(s + full, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < full; j += 16)
    _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  if (tail)
    _mm512_mask_storeu_ps(s + full, tail,
                          _mm512_mul_ps(_mm512_mask_loadu_ps(ninf, tail, s + full), inv));
}

// V rows of kv head h for keys [0, nk) as fp32 [nk, D]
template <int D>
inline void values_f32(const at::BFloat16* vc, const int64_t* table, float* vf, int64_t nk,
                       int64_t h, int64_t hkv, int64_t block_size) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const at::BFloat16* row = vc + (slot * hkv + h) * D;
    for (int64_t x = 0; x < D; x += 16) _mm512_storeu_ps(vf + j * D + x, load16(row + x));
  }
}

// weighted_values_regs over fp32 V rows [nk, 16 CHUNKS] (values_f32), key by key with no
// block table, 6 rows at a time (24 accumulators): weighted_values_rows' 4-row blocks run on
// the same fp32 rows took 2.5 ms where this takes 2.0 (21-token tree query, 30 layers)
template <int ROWS, int CHUNKS>
inline void weighted_values_f32_regs(const float* p, const float* vf, float* acc, int64_t nk) {
  constexpr int64_t d = CHUNKS * 16;
  __m512 a[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = _mm512_loadu_ps(vf + j * d + c * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * nk + j]);
      for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + r * d + c * 16, a[r][c]);
}

// From this many rows per kv head a job converts the head's V rows to fp32 once and reads
// them from there (weighted_values_rows converts every V row again for each block of 4 rows:
// 16 times for a verify step's 63 rows). A row's arithmetic is the same either way: the same
// fp32 values, summed over the keys in order. 30 layers of a 21-token tree query over 150
// keys, 2 threads: 3.0 -> 2.0 ms (benchmarks/tree_attention.py).
constexpr int64_t VALUES_F32_MIN_ROWS = 8;

template <int CHUNKS>
void weighted_values_f32(const float* p, const float* vf, float* acc, int64_t rows,
                         int64_t nk) {
  constexpr int64_t d = CHUNKS * 16;
  constexpr int R = CHUNKS == 4 ? 6 : 3;  // 24 accumulators in registers
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R)
    weighted_values_f32_regs<R, CHUNKS>(p + r0 * nk, vf, acc + r0 * d, nk);
  for (; r0 < rows; ++r0) weighted_values_f32_regs<1, CHUNKS>(p + r0 * nk, vf, acc + r0 * d, nk);
}

// attend_one for bf16 caches and head dims 64/128, over kv heads [h0, h1) and query tokens
// [i0, i1) of one sequence at once: each block's cache rows (every head of a slot is one
// contiguous row) are read in one sweep and the next block's keys and this block's values are
// prefetched, so a sequence's KV streams from memory instead of arriving head by head in
// scattered lines. Each query row's arithmetic is the same whichever others share its job.
template <int D>
void attend_heads_bf16(const at::BFloat16* qp, const at::BFloat16* kc,
                       const at::BFloat16* vc, at::BFloat16* op, const int64_t* table,
                       int64_t t0, int64_t i0, int64_t i1, int64_t ctx, int64_t h0, int64_t h1,
                       int64_t hkv, int64_t group, int64_t q_row, int64_t q_head,
                       int64_t block_size, float scale, const int64_t* tree,
                       std::vector<uint16_t>& qb, std::vector<float>& scores,
                       std::vector<float>& acc, std::vector<float>& vf) {
  // token i sees keys up to ctx + i: the job's last token bounds the keys it reads
  const int64_t nq = i1 - i0, nk = ctx + i1, rows = nq * group, heads = h1 - h0;
  const int64_t stride = hkv * D;
  t0 += i0;
  qb.resize(heads * rows * D);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const auto* src = reinterpret_cast<const uint16_t*>(
            qp + (t0 + i) * q_row + (h * group + g) * q_head);
        std::copy(src, src + D, qb.data() + ((h - h0) * rows + i * group + g) * D);
      }
  scores.resize(heads * rows * nk);
  const __m512 sc = _mm512_set1_ps(scale);
  touch_rows(kc, vc, table, nk, stride, block_size);
  for (int64_t j0 = 0; j0 < nk;) {
    const int64_t n = std::min<int64_t>({16, block_size - j0 % block_size, nk - j0});
    const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
    for (int64_t h = h0; h < h1; ++h)
      score_keys<D>(qb.data() + (h - h0) * rows * D, rows, kc + slot * stride + h * D, stride,
                    n, scores.data() + (h - h0) * rows * nk + j0, nk, sc);
    j0 += n;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores.data() + h * rows * nk;
    mask_query_block(sh, tree, t0, nq, ctx, nk, group, i0);
    for (int64_t r = 0; r < rows; ++r) softmax_row16(sh + r * nk, nk);
  }
  acc.resize(heads * rows * D);
  for (int64_t h = h0; h < h1; ++h) {
    const float* p = scores.data() + (h - h0) * rows * nk;
    float* a = acc.data() + (h - h0) * rows * D;
    if (rows >= VALUES_F32_MIN_ROWS) {
      vf.resize(nk * D);
      values_f32<D>(vc, table, vf.data(), nk, h, hkv, block_size);
      weighted_values_f32<D / 16>(p, vf.data(), a, rows, nk);
    } else {
      weighted_values_rows<D / 16>(p, vc, table, a, rows, nk, h, hkv, block_size);
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < group; ++g) {
        at::BFloat16* dst = op + (t0 + i) * (hkv * group * D) + (h * group + g) * D;
        const float* a = acc.data() + ((h - h0) * rows + i * group + g) * D;
        for (int64_t x = 0; x < D; x += 16)  // round to nearest even, as static_cast
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + x)));
      }
}
#endif

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& tree_mask) {
  const int64_t num_seqs = context_lens.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), group = hq / hkv;
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              out.is_contiguous(), "paged_attention: unexpected layout");
  auto bt = block_table.contiguous().to(at::kLong);
  auto qs = query_start.contiguous().to(at::kLong);
  auto ql = query_lens.contiguous().to(at::kLong);
  auto ctx = context_lens.contiguous().to(at::kLong);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t *qsp = qs.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>();
  const int64_t* cxp = ctx.data_ptr<int64_t>();
  const int64_t bt_width = bt.size(1);
  at::Tensor tm;
  if (tree_mask.has_value()) {
    tm = tree_mask->contiguous().to(at::kLong);
    TORCH_CHECK(tm.dim() == 1 && tm.size(0) >= q.size(0), "paged_attention: tree_mask must "
                "hold one entry per flat token");
  }
  const int64_t* tree = tree_mask.has_value() ? tm.data_ptr<int64_t>() : nullptr;
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && (d == 64 || d == 128)) {
    // a job per sequence (all its heads) when there are enough to share out, else per head;
    // and where too few per-head jobs would leave threads idle (a verify step at batch 1: 3
    // kv heads on 2 threads is one thread's 2 heads against the other's 1), per head and
    // slice of the sequence's query tokens
    const int64_t threads = at::get_num_threads();
    const int64_t per_job = num_seqs >= 2 * threads ? hkv : 1;
    const int64_t jobs_per_seq = hkv / per_job;
    int64_t max_q = 0;
    for (int64_t s = 0; s < num_seqs; ++s) max_q = std::max(max_q, qlp[s]);
    const int64_t slices = (per_job == 1 && (num_seqs * hkv) % threads != 0)
                               ? std::min(threads, max_q) : 1;
    const auto f = d == 64 ? &attend_heads_bf16<64> : &attend_heads_bf16<128>;
    at::parallel_for(0, num_seqs * jobs_per_seq * slices, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> qb;
      std::vector<float> scores, acc, vf;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t slice = job % slices, head_job = job / slices;
        const int64_t s = head_job / jobs_per_seq, h0 = head_job % jobs_per_seq * per_job;
        // equal slices of the query tokens (token i reads ctx + i + 1 keys: about equal work)
        const int64_t nq = qlp[s], i0 = nq * slice / slices, i1 = nq * (slice + 1) / slices;
        if (i0 == i1) continue;
        f(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
          v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), btp + s * bt_width,
          qsp[s], i0, i1, cxp[s], h0, h0 + per_job, hkv, group, q.stride(0), q.stride(1),
          block_size, static_cast<float>(scale), tree, qb, scores, acc, vf);
      }
    });
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attn", [&] {
    at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, scores, acc;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t s = job / hkv;
        attend_one<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                             v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             btp + s * bt_width, qsp[s], qlp[s], cxp[s], job % hkv, hkv, group,
                             d, q.stride(0), q.stride(1), block_size,
                             static_cast<float>(scale), tree, qf, scores, acc);
      }
    });
  });
}

// -- Prefill attention for long queries (bf16 with AVX512-BF16) -------------------------------
//
// Same contract as paged_attention, for sequences whose query is a long prefill chunk, where
// torch's CPU flash attention reaches only ~0.12 TFLOP/s here. Per (sequence, kv head) the keys
// and values are first copied out of the paged cache into the layouts vdpbf16ps reads (each
// 32-bit lane a pair of bf16): K as [block of 16 keys][dim pair][16 keys][2] and V as
// [key pair][dim][2]. Then per (sequence, kv head, tile of query positions): scores q.K in fp32
// (register tile 4 rows x 64 keys), an exact softmax per row over the keys its position may see
// (fp32; the unnormalized probabilities rounded to bf16, as torch's flash attention does), P.V
// in fp32 (register tile 4 rows x 64 dims) divided by the row's sum. Tiles are handed out
// longest first and dynamically, so the causal imbalance evens out across threads.
#if defined(__AVX512BF16__)

template <int D>
void pack_keys(const at::BFloat16* kc, const int64_t* table, int64_t nk, int64_t kvh,
               int64_t hkv, int64_t block_size, uint32_t* out) {
  const int64_t nkb = (nk + 15) / 16;
  std::fill(out, out + nkb * (D / 2) * 16, 0u);
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const auto* row = reinterpret_cast<const uint32_t*>(kc + (slot * hkv + kvh) * D);
    uint32_t* dst = out + (j / 16) * (D / 2) * 16 + j % 16;
    for (int p = 0; p < D / 2; ++p) dst[p * 16] = row[p];
  }
}

template <int D>
void pack_values(const at::BFloat16* vc, const int64_t* table, int64_t nk, int64_t kvh,
                 int64_t hkv, int64_t block_size, uint16_t* out) {
  const int64_t pairs = (nk + 1) / 2;
  if (nk % 2) std::fill(out + (pairs - 1) * D * 2, out + pairs * D * 2, uint16_t{0});
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const auto* row = reinterpret_cast<const uint16_t*>(vc + (slot * hkv + kvh) * D);
    uint16_t* dst = out + (j / 2) * D * 2 + j % 2;
    for (int x = 0; x < D; ++x) dst[2 * x] = row[x];
  }
}

// s[r, 16 kb + j] = q[r] . K[16 kb + j] for 4 rows (bf16 pairs [4][D/2]) and nkb key blocks.
template <int D>
void qk_rows4(const uint32_t* q, const uint32_t* kp, int64_t nkb, float* s, int64_t ld) {
  constexpr int P = D / 2;
  int64_t kb = 0;
  for (; kb + 4 <= nkb; kb += 4) {
    __m512 acc[4][4];
    for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      __m512i k[4];
      for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_si512(kp + ((kb + c) * P + p) * 16);
      for (int r = 0; r < 4; ++r) {
        const __m512i b = _mm512_set1_epi32(static_cast<int>(q[r * P + p]));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(b), as_bh(k[c]));
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * ld + (kb + c) * 16, acc[r][c]);
  }
  for (; kb < nkb; ++kb) {
    __m512 acc[4];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512i k = _mm512_loadu_si512(kp + (kb * P + p) * 16);
      for (int r = 0; r < 4; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_set1_epi32(static_cast<int>(q[r * P + p]))),
                                  as_bh(k));
    }
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(s + r * ld + kb * 16, acc[r]);
  }
}

// o[r] = sum_j p[r, j] V[j] for R rows (p: bf16 rows of ldp pairs) over `pairs` key pairs.
template <int D, int R>
void pv_rows(const uint32_t* p, int64_t ldp, const uint16_t* vp, int64_t pairs, float* o) {
  constexpr int C = D / 16;
  __m512 acc[R][C];
  for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_si512(vp + (jp * D + c * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(static_cast<int>(p[r * ldp + jp]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(b), as_bh(v[c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// Softmax numerator of one score row over its first n keys: p = bf16(e^(scale (s - max))),
// zero up to `width` (even); returns the fp32 sum of the unrounded exponentials.
inline float softmax_bf16_row(float* s, int64_t n, int64_t width, float scale, uint16_t* p) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  const __m512 sc = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-mx * scale);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp512(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), sc, shift));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; j < n; ++j) {
    const float e = std::exp(s[j] * scale - mx * scale);
    total += e;
    const at::BFloat16 b(e);
    p[j] = b.x;
  }
  std::fill(p + n, p + width, uint16_t{0});
  return total;
}

template <int D>
void prefill_tile(const at::BFloat16* q, int64_t q_row, int64_t q_head, at::BFloat16* out,
                  const uint32_t* kp, const uint16_t* vp, int64_t t0, int64_t ctx, int64_t i0,
                  int64_t i1, int64_t kvh, int64_t hkv, int64_t group, float scale,
                  std::vector<uint32_t>& qbuf, std::vector<float>& sbuf,
                  std::vector<uint16_t>& pbuf, std::vector<float>& obuf) {
  constexpr int P = D / 2;
  constexpr int RV = D == 64 ? 4 : 2;  // rows per P.V register tile
  const int64_t rows = (i1 - i0) * group, rows4 = (rows + 3) / 4 * 4;
  const int64_t nk = ctx + i1;  // keys the tile's last position sees
  const int64_t nkb = (nk + 15) / 16, ld = nkb * 16, ldp = ld / 2;
  qbuf.assign(rows4 * P, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* src = reinterpret_cast<const uint32_t*>(
        q + (t0 + i0 + r / group) * q_row + (kvh * group + r % group) * q_head);
    std::copy(src, src + P, qbuf.data() + r * P);
  }
  sbuf.resize(rows4 * ld);
  pbuf.resize(rows4 * ld);
  obuf.resize(rows4 * D);
  for (int64_t r = 0; r < rows4; r += 4) qk_rows4<D>(qbuf.data() + r * P, kp, nkb, sbuf.data() + r * ld, ld);
  std::vector<float> inv(rows4, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = ctx + i0 + r / group + 1;
    inv[r] = 1.f / softmax_bf16_row(sbuf.data() + r * ld, n, ld, scale, pbuf.data() + r * ld);
  }
  std::fill(pbuf.data() + rows * ld, pbuf.data() + rows4 * ld, uint16_t{0});
  const auto* pp = reinterpret_cast<const uint32_t*>(pbuf.data());
  for (int64_t r = 0; r < rows4; r += RV) {
    const int64_t last = std::min(r + RV, rows) - 1;  // the row that sees the most keys
    const int64_t pairs = last < r ? 0 : (ctx + i0 + last / group + 2) / 2;
    pv_rows<D, RV>(pp + r * ldp, ldp, vp, pairs, obuf.data() + r * D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* dst = out + (t0 + i0 + r / group) * (hkv * group * D) + (kvh * group + r % group) * D;
    const float* o = obuf.data() + r * D;
    for (int x = 0; x < D; ++x) dst[x] = static_cast<at::BFloat16>(o[x] * inv[r]);
  }
}

template <int D>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const int64_t* bt, int64_t bt_width,
                            const int64_t* qs, const int64_t* ql, const int64_t* cx,
                            int64_t num_seqs, int64_t block_size, float scale) {
  const int64_t hq = q.size(1), hkv = k_cache.size(1), group = hq / hkv;
  // packed K/V of every (sequence, kv head), at offsets into two buffers
  std::vector<int64_t> k_off(num_seqs * hkv + 1, 0), v_off(num_seqs * hkv + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t nk = cx[s] + ql[s], job = s * hkv + h;
      k_off[job + 1] = k_off[job] + (nk + 15) / 16 * 16 * (D / 2);
      v_off[job + 1] = v_off[job] + (nk + 1) / 2 * 2 * D;
    }
  std::vector<uint32_t> kp(k_off.back());
  std::vector<uint16_t> vp(v_off.back());
  const auto* kc = k_cache.data_ptr<at::BFloat16>();
  const auto* vc = v_cache.data_ptr<at::BFloat16>();
  at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / hkv, nk = cx[s] + ql[s];
      pack_keys<D>(kc, bt + s * bt_width, nk, job % hkv, hkv, block_size, kp.data() + k_off[job]);
      pack_values<D>(vc, bt + s * bt_width, nk, job % hkv, hkv, block_size, vp.data() + v_off[job]);
    }
  });
  struct Tile { int64_t s, h, i0, i1, cost; };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t nk = cx[s] + ql[s];
    // ~256 KB of fp32 scores per tile, 4..32 query positions
    const int64_t span = std::clamp<int64_t>((256 * 1024) / (4 * group * nk), 4, 32);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t i0 = 0; i0 < ql[s]; i0 += span) {
        const int64_t i1 = std::min(ql[s], i0 + span);
        tiles.push_back({s, h, i0, i1, (i1 - i0) * (cx[s] + i1)});
      }
  }
  std::sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<uint32_t> qbuf;
    std::vector<float> sbuf, obuf;
    std::vector<uint16_t> pbuf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const Tile& tile = tiles[t];
      const int64_t job = tile.s * hkv + tile.h;
      prefill_tile<D>(qp, q.stride(0), q.stride(1), op, kp.data() + k_off[job],
                      vp.data() + v_off[job], qs[tile.s], cx[tile.s], tile.i0, tile.i1, tile.h,
                      hkv, group, scale, qbuf, sbuf, pbuf, obuf);
    }
  }
}
#endif

bool has_bf16_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Long-query attention: bf16 q/caches, head dim 64 or 128 (callers check has_bf16_attention).
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, int64_t block_size, double scale) {
#if defined(__AVX512BF16__)
  const int64_t d = q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 only");
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head dim 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && out.is_contiguous(), "prefill_attention: unexpected layout");
  auto bt = block_table.contiguous().to(at::kLong);
  auto qs = query_start.contiguous().to(at::kLong);
  auto ql = query_lens.contiguous().to(at::kLong);
  auto cx = context_lens.contiguous().to(at::kLong);
  const auto f = d == 64 ? &prefill_attention_impl<64> : &prefill_attention_impl<128>;
  f(out, q, k_cache, v_cache, bt.data_ptr<int64_t>(), bt.size(1), qs.data_ptr<int64_t>(),
    ql.data_ptr<int64_t>(), cx.data_ptr<int64_t>(), cx.size(0), block_size,
    static_cast<float>(scale));
#else
  TORCH_CHECK(false, "prefill_attention: built without AVX512-BF16");
#endif
}

// -- int8 weight-only matmul for a few tokens --------------------------------------------------
//
// y[m, n] = scale[n] * sum_k x[m, k] w[n, k]; x [M, K] float, w int8 [N, K] row-major, scale
// fp32 [N]; y [M, N] in x's dtype. Weight-only: x stays float (converted to fp32 once per call)
// and every product is accumulated in fp32. Decode is memory-bound, so the kernel reads each
// weight row once for up to 8 tokens, R rows at a time (R * M accumulators in registers).
// Each output is summed by one thread in a fixed order: results do not depend on threads.
constexpr int64_t kInt8TokenTile = 8;

#if defined(__AVX2__)
// The sum of 8 fp32 lanes (the AVX2 paths of the int8 and bf16 kernels).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 int8_to_ps(__m128i codes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)); }

// out[r * M + m] = x[m] . w[r] for R consecutive weight rows; K % 16 tail by masked loads.
template <int M, int R>
void int8_dot_rows(const float* xf, const int8_t* w, int64_t K, float* out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask16 mask) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, xf + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = int8_to_ps(_mm_maskz_loadu_epi8(mask, w + r * K + k));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  };
  // The R rows stream from memory side by side, which the hardware prefetcher follows
  // poorly: fetch the same cache line of the next R rows (the next block) while computing.
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    step(k, all), step(k + 16, all), step(k + 32, all), step(k + 48, all);
  }
  for (int r = 0; r < R && k < K; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
  for (; k + 16 <= K; k += 16) step(k, all);
  if (k < K) step(k, static_cast<__mmask16>((1u << (K - k)) - 1));
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same on AVX2: 8 lanes, R * M + R + 1 of 16 registers; K % 8 tail in scalar.
template <int M, int R>
void int8_dot_rows(const float* xf, const int8_t* w, int64_t K, float* out) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * K + k))));
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = hsum8(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += xf[m * K + t] * static_cast<float>(w[r * K + t]);
      out[r * M + m] = s;
    }
}
#else
template <int M, int R>
void int8_dot_rows(const float* xf, const int8_t* w, int64_t K, float* out) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xf[m * K + k] * static_cast<float>(w[r * K + k]);
      out[r * M + m] = acc;
    }
}
#endif

// y rows [0, M) from xf [M, K]; output rows split across threads in blocks of R.
template <typename T, int M, int R>
void int8_mm_tile(const float* xf, const int8_t* w, const float* scale, T* y, int64_t N,
                  int64_t K) {
  const int64_t blocks = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (R * K));  // >= ~32 KiB each
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float acc[R * M];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, N - n0);
      if (rows == R) {
        int8_dot_rows<M, R>(xf, w + n0 * K, K, acc);
      } else {
        for (int64_t r = 0; r < rows; ++r) int8_dot_rows<M, 1>(xf, w + (n0 + r) * K, K, acc + r * M);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) y[m * N + n0 + r] = static_cast<T>(scale[n0 + r] * acc[r * M + m]);
    }
  });
}

// R per token count keeps R * M + M + 1 vectors within the 32 registers.
template <typename T>
void int8_mm_tokens(int64_t M, const float* xf, const int8_t* w, const float* scale, T* y,
                    int64_t N, int64_t K) {
  switch (M) {
    case 1: return int8_mm_tile<T, 1, 8>(xf, w, scale, y, N, K);
    case 2: return int8_mm_tile<T, 2, 4>(xf, w, scale, y, N, K);
    case 3: return int8_mm_tile<T, 3, 2>(xf, w, scale, y, N, K);
    case 4: return int8_mm_tile<T, 4, 2>(xf, w, scale, y, N, K);
    case 5: return int8_mm_tile<T, 5, 2>(xf, w, scale, y, N, K);
    case 6: return int8_mm_tile<T, 6, 2>(xf, w, scale, y, N, K);
    case 7: return int8_mm_tile<T, 7, 2>(xf, w, scale, y, N, K);
    default: return int8_mm_tile<T, 8, 2>(xf, w, scale, y, N, K);
  }
}

// Any M works (in tiles of 8 tokens, each re-reading the weights); callers use it for M <= 8.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "int8_gemv: x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_gemv: w must be int8");
  TORCH_CHECK(scale.numel() == w.size(0), "int8_gemv: one scale per output row expected");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto sc = scale.reshape(-1).to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "int8_gemv", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = f32(xp[i]);
    for (int64_t m0 = 0; m0 < M; m0 += kInt8TokenTile)
      int8_mm_tokens<scalar_t>(std::min(kInt8TokenTile, M - m0), xf.data() + m0 * K,
                               wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                               y.data_ptr<scalar_t>() + m0 * N, N, K);
  });
  return y;
}

// -- bf16 weights on CPUs without bf16 arithmetic ---------------------------------------------
//
// y[m, n] = sum_k x[m, k] w[n, k]; w bf16 [N, K] row-major, x [M, K] float, y in x's dtype.
// Where oneDNN cannot prepack bf16 (AVX2 CPUs with no AVX-512 BW or AVX-NE-CONVERT), torch's
// bf16 matmul runs at ~16 GFLOP/s at every token count, so a 4-token verify step costs four
// decode steps. Here a bf16 weight widens to fp32 exactly (a 16-bit shift) inside the FMA loop:
// each weight row is read once for up to 8 tokens, as the int8 kernel does. Every output is the
// same 8-lane fp32 sum in the same k order for any M, R or thread count, so a token's result
// does not depend on the batch it runs in.
constexpr int64_t kBf16TokenTile = 8;

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8_to_ps(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// out[r * M + m] = x[m] . w[r] for R consecutive weight rows (R * M + R + 1 of 16 registers).
template <int M, int R>
void bf16_dot_rows(const float* xf, const at::BFloat16* w, int64_t K, float* out) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = bf16x8_to_ps(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // one 64-byte line of each row; fetch the next block's
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    step(k), step(k + 8), step(k + 16), step(k + 24);
  }
  for (; k + 8 <= K; k += 8) step(k);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = hsum8(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += xf[m * K + t] * f32(w[r * K + t]);
      out[r * M + m] = s;
    }
}
constexpr bool kBf16GemmVectorized = true;
#else
template <int M, int R>
void bf16_dot_rows(const float* xf, const at::BFloat16* w, int64_t K, float* out) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xf[m * K + k] * f32(w[r * K + k]);
      out[r * M + m] = acc;
    }
}
constexpr bool kBf16GemmVectorized = false;
#endif

template <typename T, int M, int R>
void bf16_mm_tile(const float* xf, const at::BFloat16* w, T* y, int64_t N, int64_t K) {
  const int64_t blocks = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (R * K * 2));  // ~32 KiB
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float acc[R * M];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, N - n0);
      if (rows == R) {
        bf16_dot_rows<M, R>(xf, w + n0 * K, K, acc);
      } else {
        for (int64_t r = 0; r < rows; ++r) bf16_dot_rows<M, 1>(xf, w + (n0 + r) * K, K, acc + r * M);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) y[m * N + n0 + r] = static_cast<T>(acc[r * M + m]);
    }
  });
}

template <typename T>
void bf16_mm_tokens(int64_t M, const float* xf, const at::BFloat16* w, T* y, int64_t N,
                    int64_t K) {
  switch (M) {
    case 1: return bf16_mm_tile<T, 1, 6>(xf, w, y, N, K);
    case 2: return bf16_mm_tile<T, 2, 4>(xf, w, y, N, K);
    case 3: return bf16_mm_tile<T, 3, 3>(xf, w, y, N, K);
    case 4: return bf16_mm_tile<T, 4, 2>(xf, w, y, N, K);
    case 5: return bf16_mm_tile<T, 5, 2>(xf, w, y, N, K);
    case 6: return bf16_mm_tile<T, 6, 2>(xf, w, y, N, K);
    case 7: return bf16_mm_tile<T, 7, 1>(xf, w, y, N, K);
    default: return bf16_mm_tile<T, 8, 1>(xf, w, y, N, K);
  }
}

// Any M works (tiles of 8 tokens, each re-reading the weights); callers use it for few tokens.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_gemm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16_gemm: w must be bfloat16");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = at::empty({M, N}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "bf16_gemm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = f32(xp[i]);
    for (int64_t m0 = 0; m0 < M; m0 += kBf16TokenTile)
      bf16_mm_tokens<scalar_t>(std::min(kBf16TokenTile, M - m0), xf.data() + m0 * K,
                               wc.data_ptr<at::BFloat16>(), y.data_ptr<scalar_t>() + m0 * N,
                               N, K);
  });
  return y;
}

bool bf16_gemm_vectorized() { return kBf16GemmVectorized; }

// -- The whole decoder stack of a Llama-family model in one call ------------------------------
//
// The same ops, in the same order and with the same roundings, as LlamaDecoderLayer.forward on
// kiln's fast path (fused norms, oneDNN-prepacked bf16 linears, in-place rotary, the cpu
// attention backend), for every layer, without returning to Python in between: at batch 1 the
// ~20 Python-level calls per layer cost more than the layer's norms, rotary and attention
// together. Linears are oneDNN bf16, or kiln's int8 GEMV or bf16_gemm (both on decode-sized
// steps). Used only where the model has no hooks, biases or q/k norms (LlamaForCausalLM
// decides); its result is bit-identical to the per-layer path, which the tests check.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        c10::string_view, c10::List<std::optional<at::Scalar>>,
                        std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// Layer l of one projection: int8 weights with per-row scales through int8_gemv where the
// layer has a scale, else bf16 weights: plain ones through bf16_gemm (fp32 arithmetic, CPUs
// without bf16 instructions) where plain_bf16, oneDNN-prepacked ones otherwise.
at::Tensor stack_linear(const at::Tensor& x, at::TensorList weights, at::TensorList scales,
                        int64_t l, bool plain_bf16) {
  if (!scales.empty() && scales[l].numel() > 0) return int8_gemv(x, weights[l], scales[l]);
  if (plain_bf16) return bf16_gemm(x, weights[l]);
  return onednn_linear(x, weights[l]);
}

at::Tensor llama_stack(const at::Tensor& x_in, const at::Tensor& positions,
                       at::TensorList input_norm, at::TensorList qkv_proj,
                       at::TensorList o_proj, at::TensorList post_norm,
                       at::TensorList gate_up_proj, at::TensorList down_proj,
                       at::TensorList qkv_scale, at::TensorList o_scale,
                       at::TensorList gate_up_scale, at::TensorList down_scale,
                       const at::Tensor& final_norm, const at::Tensor& cos32,
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
                       int64_t head_dim, bool plain_bf16) {
  const int64_t layers = static_cast<int64_t>(qkv_proj.size());
  const int64_t tokens = x_in.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in, residual;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, input_norm[l], eps);
    } else {
      h = add_rms_norm(x, residual, input_norm[l], eps);
    }
    at::Tensor qkv = stack_linear(h, qkv_proj, qkv_scale, l, plain_bf16);
    rotary_inplace(qkv, positions, cos32, sin32, num_heads, num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                             .view({tokens, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor attn = at::empty({tokens, q_size}, qkv.options());
    if (short_table.has_value())
      paged_attention(attn, q, k_cache, v_cache, *short_table, *short_start, *short_lens,
                      *short_context, block_size, scale, short_tree);
    if (long_table.has_value())
      prefill_attention(attn, q, k_cache, v_cache, *long_table, *long_start, *long_lens,
                        *long_context, block_size, scale);
    h = add_rms_norm(stack_linear(attn, o_proj, o_scale, l, plain_bf16), residual,
                     post_norm[l], eps);
    x = stack_linear(silu_mul(stack_linear(h, gate_up_proj, gate_up_scale, l, plain_bf16)),
                     down_proj, down_scale, l, plain_bf16);
  }
  return add_rms_norm(x, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(kiln, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &add_rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  m.def("rotary_inplace(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "int num_q_heads, int num_kv_heads, int head_dim) -> ()", &rotary_inplace);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()", &write_kv);
  m.def("move_slots(Tensor(a!)[] caches, Tensor src, Tensor dst) -> ()", &move_slots);
  m.def("top_logprobs(Tensor logits, int k, Tensor ids) -> (Tensor, Tensor)", &top_logprobs);
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale, Tensor? tree_mask=None) -> ()", &paged_attention);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale) -> ()", &prefill_attention);
  m.def("has_bf16_attention() -> bool", &has_bf16_attention);
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor", &int8_gemv);
  m.def("bf16_gemm(Tensor x, Tensor w) -> Tensor", &bf16_gemm);
  m.def("bf16_gemm_vectorized() -> bool", &bf16_gemm_vectorized);
  m.def("llama_stack(Tensor x, Tensor positions, Tensor[] input_norm, Tensor[] qkv_proj, "
        "Tensor[] o_proj, Tensor[] post_norm, Tensor[] gate_up_proj, Tensor[] down_proj, "
        "Tensor[] qkv_scale, Tensor[] o_scale, Tensor[] gate_up_scale, Tensor[] down_scale, "
        "Tensor final_norm, Tensor cos32, Tensor sin32, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor slot_mapping, Tensor? short_table, Tensor? short_start, Tensor? short_lens, "
        "Tensor? short_context, Tensor? short_tree, Tensor? long_table, Tensor? long_start, "
        "Tensor? long_lens, Tensor? long_context, int block_size, float scale, float eps, "
        "int num_heads, int num_kv_heads, int head_dim, bool plain_bf16) -> Tensor",
        &llama_stack);
}
