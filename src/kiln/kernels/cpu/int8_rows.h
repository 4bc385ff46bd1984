// The int8 weight-only row dot products of kiln's int8 GEMV (layout, numerics and torch
// reference: the int8 section of gemm.cpp), shared by the dense int8 linears (gemm.cpp) and the
// fused experts (moe.cpp), so an expert's rows are summed exactly as its own linear sums them.
#pragma once

#include "common.h"

namespace kiln {

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
  auto step = [&](int64_t k) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * K + k))));
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // the same line of the next R rows fetched meanwhile
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    for (int64_t j = 0; j < 64; j += 8) step(k + j);
  }
  for (; k + 8 <= K; k += 8) step(k);
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

}  // namespace kiln
