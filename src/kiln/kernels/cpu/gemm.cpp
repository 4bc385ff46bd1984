// Matmuls for decode-sized token counts: int8 weight-only (per-row scales) and bf16 weights
// with fp32 arithmetic. Torch reference: dequantize (or widen) then matmul.

#include "int8_rows.h"
#include "ops.h"

namespace kiln {

// -- int8 weight-only matmul for a few tokens --------------------------------------------------
//
// y[m, n] = scale[n] * sum_k x[m, k] w[n, k]; x [M, K] float, w int8 [N, K] row-major, scale
// fp32 [N]; y [M, N] in x's dtype. Weight-only: x stays float (converted to fp32 once per call)
// and every product is accumulated in fp32. Decode is memory-bound, so the kernel reads each
// weight row once for up to 8 tokens, R rows at a time (R * M accumulators in registers).
// Each output is summed by one thread in a fixed order: results do not depend on threads.
namespace {

constexpr int64_t kInt8TokenTile = 8;

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

// R per token count keeps R * M + M + 1 vectors within the 32 registers (AVX-512), R * M +
// R + 1 within 16 (AVX2, where 8 rows of one token spilled accumulators to the stack).
template <typename T>
void int8_mm_tokens(int64_t M, const float* xf, const int8_t* w, const float* scale, T* y,
                    int64_t N, int64_t K) {
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
  switch (M) {
    case 1: return int8_mm_tile<T, 1, 4>(xf, w, scale, y, N, K);
    case 2: return int8_mm_tile<T, 2, 3>(xf, w, scale, y, N, K);
    case 3: case 4: case 5: case 6: break;  // R = 2, as below
    case 7: return int8_mm_tile<T, 7, 1>(xf, w, scale, y, N, K);
    default: return int8_mm_tile<T, 8, 1>(xf, w, scale, y, N, K);
  }
#endif
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

}  // namespace

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
// decode steps. Here a bf16 weight widens to fp32 exactly inside the FMA loop (decision 0026):
// a 32-bit lane holds two neighbouring weights, so AND-ing away the low half gives the odd one
// as fp32 and a 16-bit shift the even one, against x split once per call into its even and odd
// elements. One token walks each thread's contiguous rows one at a time: a single stream, which
// the hardware prefetcher follows, the next kilobyte fetched ahead (6 rows read side by side,
// 6 streams, came at ~2/3 of the rate on Zen 3). More tokens go in tiles of 2 tokens by 2
// rows (each widened weight serves 2 tokens, each x vector 2 rows), every token pair passing
// over a pair of rows while it sits in L1. Every output is the same even and odd 8-lane fp32
// sums in the same k order for any M, tile or thread count, so a token's result does not
// depend on the batch it runs in.
namespace {

constexpr int64_t kBf16BlockBytes = 16 << 10;  // rows a thread takes at a time
constexpr int64_t kBf16FetchAhead = 1024;      // bytes of the stream fetched ahead

#if defined(__AVX2__) && defined(__FMA__)
// hsum(even + odd) + the K % 16 tail from k on: one compiled body for every tile shape
// (-ffast-math may reassociate additions differently in each copy of an inlined body, which
// would make a token's sum depend on its tile).
__attribute__((noinline)) float bf16_row_finish(__m256 even, __m256 odd, const float* xf,
                                                const at::BFloat16* w, int64_t k, int64_t K) {
  float s = hsum8(_mm256_add_ps(even, odd));
  for (; k < K; ++k) s += xf[k] * f32(w[k]);
  return s;
}

// out[r * T + m] = x[m] . w[r] for T <= 2 tokens and R <= 2 consecutive weight rows: xs holds
// each token's ceil(K / 2) even elements, then its K / 2 odd ones (2 * half per token), xf the
// rows as given. 16 weights a step into an even and an odd accumulator per row and token, each
// weight widened once for the T tokens, each x vector loaded once for the R rows.
template <int T, int R>
__attribute__((noinline)) void bf16_rows_dot(const float* xs, const float* xf, int64_t half,
                                             const at::BFloat16* w, int64_t K, float* out) {
  __m256 even[R][T], odd[R][T];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < T; ++m) even[r][m] = odd[r][m] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto step = [&](int64_t k) {
    __m256 xe[T], xo[T];
    for (int m = 0; m < T; ++m) {
      xe[m] = _mm256_loadu_ps(xs + m * 2 * half + k / 2);
      xo[m] = _mm256_loadu_ps(xs + m * 2 * half + half + k / 2);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int m = 0; m < T; ++m) {
        even[r][m] = _mm256_fmadd_ps(we, xe[m], even[r][m]);
        odd[r][m] = _mm256_fmadd_ps(wo, xo[m], odd[r][m]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (R == 1)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kBf16FetchAhead, _MM_HINT_T0);
    else  // the same line of the next R rows
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    step(k), step(k + 16);
  }
  if (k + 16 <= K) step(k), k += 16;
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < T; ++m)
      out[r * T + m] = bf16_row_finish(even[r][m], odd[r][m], xf + m * K, w + r * K, k, K);
}
constexpr bool kBf16GemmVectorized = true;
#else
template <int T, int R>
void bf16_rows_dot(const float*, const float* xf, int64_t, const at::BFloat16* w, int64_t K,
                   float* out) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < T; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xf[m * K + k] * f32(w[r * K + k]);
      out[r * T + m] = acc;
    }
}
constexpr bool kBf16GemmVectorized = false;
#endif

// y[m, n] for tokens [m0, m0 + T) and rows [n, n + R), written as Y.
template <typename Y, int T, int R>
inline void bf16_tile(const float* xs, const float* xf, int64_t half, const at::BFloat16* w,
                      int64_t n, int64_t m0, Y* y, int64_t N, int64_t K) {
  float out[T * R];
  bf16_rows_dot<T, R>(xs + m0 * 2 * half, xf + m0 * K, half, w + n * K, K, out);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < T; ++m) y[(m0 + m) * N + n + r] = static_cast<Y>(out[r * T + m]);
}

// y [M, N] = xf [M, K] (fp32) @ w^T in fp32, written as Y.
template <typename Y>
void bf16_mm_fp32(const float* xf, int64_t M, const at::BFloat16* w, Y* y, int64_t N,
                  int64_t K) {
  const int64_t half = (K + 1) / 2;
  std::vector<float> xs(M * 2 * half, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xs[m * 2 * half + (k % 2) * half + k / 2] = xf[m * K + k];
  const int64_t block = std::max<int64_t>(2, kBf16BlockBytes / (2 * K)) / 2 * 2;
  const int64_t blocks = (N + block - 1) / block;
  const float* x = xs.data();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, n1 = std::min<int64_t>(N, n0 + block);
      if (M == 1) {  // one row at a time: a single stream
        for (int64_t n = n0; n < n1; ++n) bf16_tile<Y, 1, 1>(x, xf, half, w, n, 0, y, N, K);
        continue;
      }
      // pairs of rows, each passed over by every pair of tokens while it sits in L1
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) {
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2) bf16_tile<Y, 2, 2>(x, xf, half, w, n, m0, y, N, K);
        if (m0 < M) bf16_tile<Y, 1, 2>(x, xf, half, w, n, m0, y, N, K);
      }
      if (n < n1) {
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2) bf16_tile<Y, 2, 1>(x, xf, half, w, n, m0, y, N, K);
        if (m0 < M) bf16_tile<Y, 1, 1>(x, xf, half, w, n, m0, y, N, K);
      }
    }
  });
}

}  // namespace

// Any M works (each row pair read from memory once); callers use it for few tokens.
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
    bf16_mm_fp32<scalar_t>(xf.data(), M, wc.data_ptr<at::BFloat16>(), y.data_ptr<scalar_t>(),
                           N, K);
  });
  return y;
}

bool bf16_gemm_vectorized() { return kBf16GemmVectorized; }

// -- bf16 weights to fp32 outputs (the LM head: logits are never rounded to bf16) -------------
//
// y[m, n] = sum_k x[m, k] w[n, k] in fp32, written as fp32: rounding logits to bf16 (spacing
// 0.0625 at 10) ties a prompt's two best candidates as often as not. With AVX512-BF16 and bf16
// x, 32 products per dot-product instruction (each exact in fp32, summed in fp32); otherwise x
// widens to fp32 and the loop above runs with fp32 outputs. A block of R weight rows stays in
// L1 while every token tile of x (in L2) passes over it, so the weights stream from memory
// once at any token count. Every output is the same 16-lane sum in the same k order for any M,
// R or thread count: a token's logits do not depend on its batch.
namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16DotProducts = true;

// Lane j of the result = the sum of v[j]'s 16 lanes, for 16 vectors at once (a horizontal sum
// each would cost more than the dot products at K = 576). Every lane goes through the same
// tree: per 128-bit quarter (e0 + e2) + (e1 + e3), then (q0 + q1) + (q2 + q3).
inline __m512 sum_lanes16(__m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5,
                          __m512 v6, __m512 v7, __m512 v8, __m512 v9, __m512 v10, __m512 v11,
                          __m512 v12, __m512 v13, __m512 v14, __m512 v15) {
  const __m512 v[16] = {v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15};
  __m512 pair[8], quad[4];
  for (int i = 0; i < 8; ++i)
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pair[2 * i]), b = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                   _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88),
                       _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// y[m * N + n0 + r] = x[m] . w[n0 + r] for r < rows <= R, m < M (R * M <= 16 accumulators,
// the unused ones zero); 32 bf16 per step, the K % 32 tail by masked loads (zeros add nothing).
template <int M, int R>
void bf16_dp_tile(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0,
                  int64_t rows, int64_t N, int64_t K) {
  static_assert(M * R <= 16, "16 accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const at::BFloat16* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (n0 + std::min<int64_t>(r, rows - 1)) * K;
  // one loop, the tail's mask computed in it (a second copy of the body for the tail makes
  // the compiler keep the accumulators in memory)
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k + 32 <= K ? ~__mmask32{0}
                                       : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, wr[r] + k);
      for (int m = 0; m < M; ++m)
        acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], as_bh(wv), as_bh(xv[m]));
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes16(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6],
                                    acc[7], acc[8], acc[9], acc[10], acc[11], acc[12], acc[13],
                                    acc[14], acc[15]));
  for (int64_t r = 0; r < rows; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = sums[r * M + m];
}

// Blocks of R weight rows across threads (1 or 2 tokens: one tile per block). From 3 tokens,
// blocks of 16 rows (18 KiB at K = 576) stay in L1 while each tile of 4 tokens (then the tail)
// passes over their four groups of 4 rows, so x comes from L2 once per 16 rows, not per 4.
template <int M>
void bf16_dp_token_tile(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0,
                        int64_t rows, int64_t N, int64_t K) {
  for (int64_t g = 0; g < rows; g += 4)
    bf16_dp_tile<M, 4>(x, w, y, n0 + g, std::min<int64_t>(4, rows - g), N, K);
}

template <int R>
void bf16_dp_rows(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t M, int64_t N,
                  int64_t K) {
  const int64_t blocks = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (R * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R, rows = std::min<int64_t>(R, N - n0);
      if (M == 1) {
        bf16_dp_tile<1, 16>(x, w, y, n0, rows, N, K);
      } else if (M == 2) {
        bf16_dp_tile<2, 8>(x, w, y, n0, rows, N, K);
      } else {
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) bf16_dp_token_tile<4>(x + m0 * K, w, y + m0 * N, n0, rows, N, K);
        const at::BFloat16* xt = x + m0 * K;
        float* yt = y + m0 * N;
        switch (M - m0) {
          case 3: bf16_dp_token_tile<3>(xt, w, yt, n0, rows, N, K); break;
          case 2: bf16_dp_token_tile<2>(xt, w, yt, n0, rows, N, K); break;
          case 1: bf16_dp_token_tile<1>(xt, w, yt, n0, rows, N, K); break;
          default: break;
        }
      }
    }
  });
}

void bf16_dp_mm(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t M, int64_t N,
                int64_t K) {
  if (M == 2) return bf16_dp_rows<8>(x, w, y, M, N, K);
  bf16_dp_rows<16>(x, w, y, M, N, K);
}
#else
constexpr bool kBf16DotProducts = false;
#endif

}  // namespace

at::Tensor bf16_gemm_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_gemm_f32: x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16_gemm_f32: w must be bfloat16");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto wc = w.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    auto xc = x.contiguous();
    bf16_dp_mm(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<float>(),
               M, N, K);
    return y;
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  bf16_mm_fp32<float>(xf.data_ptr<float>(), M, wc.data_ptr<at::BFloat16>(), y.data_ptr<float>(),
                      N, K);
  return y;
}

bool bf16_gemm_f32_dot_products() { return kBf16DotProducts; }

}  // namespace kiln
