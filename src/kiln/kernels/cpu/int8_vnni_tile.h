// The core of kiln's weight-only int8 matmul on AVX512-VNNI dot products (layout, digit
// scheme, error bound and torch reference: the header of gemm_int8_vnni.cpp): a token's
// activations as three signed base-256 digits, and the register tiles that multiply them by
// the packed weights. Shared by the dense linears (gemm_int8_vnni.cpp) and the fused experts
// (moe.cpp), so an expert's rows are summed exactly as its own linear sums them: every output
// is the same integer sum, scaled and rounded the same way, whoever calls.
//
// Digit layout: the tokens of a matmul form tiles of up to kTokenTile consecutive tokens. A
// tile of w tokens starting at token m0 holds its digit quads at quads [3 P m0, 3 P (m0 + w))
// of the buffer as [P][w][3] int32 (each int32 four digits, one per k of the quad): one
// k-quad's 3w broadcasts are adjacent, so the tile reads them through one pointer at
// constant offsets. Token m of the tile: quad p of digit j at 3 P m0 + 3 w p + 3 (m - m0) + j.
#pragma once

#include "common.h"

namespace kiln {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KILN_INT8_VNNI 1
namespace int8_vnni {

inline constexpr int64_t kBlock = 16;     // output rows per block: one vector of int32 sums
inline constexpr int64_t kTokenTile = 8;  // tokens per tile (weights re-read from cache per tile)
inline constexpr int kDigitBits = 22;     // |x_q| <= 2^22: three balanced base-256 digits hold it
inline constexpr int64_t kMaxK = 65536;   // 255 * 128 * K < 2^31

// Where token m of `tokens` (split into tiles from token 0) keeps its digits: the offset of
// its first quad in the buffer and the distance between its consecutive quads (3 w).
struct TokenSlot {
  int64_t base, stride;
};

inline TokenSlot token_slot(int64_t m, int64_t tokens, int64_t P) {
  const int64_t m0 = m - m % kTokenTile, w = std::min(kTokenTile, tokens - m0);
  return {3 * P * m0 + 3 * (m - m0), 3 * w};
}

// 16 elements of x from k as fp32 (f32(x[k]), as the scalar reference), zeros past n.
template <typename T>
inline __m512 load16(const T* x, int64_t n) {
  const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0)
                                                               : __mmask16((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {  // bf16 = the high half of fp32
    const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
  } else {
    alignas(64) float v[16] = {};
    for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) v[i] = f32(x[i]);
    return _mm512_load_ps(v);
  }
}

// One token's activations x [K] as digits: x_q = round(x / s) with s = 2^(e - 22) the power
// of two above max|x| (so x / s is exact), x_q = d0 + 256 d1 + 65536 d2, each d_j in
// [-128, 127]. Writes every quad of the token (P of each digit; k >= K as 0) at
// quads[p * stride + j], its scale s and its offset correction 128 (D0 + 256 D1 + 65536 D2),
// D_j = sum_k d_j[k]. A non-finite element gives all-zero digits and a NaN scale (every
// output of the token is then NaN).
template <typename T>
inline void token_digits(const T* x, int64_t K, int64_t P, int32_t* quads, int64_t stride,
                         double& scale, int64_t& offset) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 amax = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 a = _mm512_and_ps(load16(x + k, K - k), abs_mask);
    finite &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::infinity()),
                                 _CMP_LT_OQ);  // false for inf and NaN
    amax = _mm512_max_ps(amax, a);
  }
  if (finite != 0xFFFF) {
    for (int64_t p = 0; p < P; ++p)
      for (int j = 0; j < 3; ++j) quads[p * stride + j] = 0;
    scale = std::numeric_limits<double>::quiet_NaN();
    offset = 0;
    return;
  }
  int e = 0;
  std::frexp(_mm512_reduce_max_ps(amax), &e);  // amax < 2^e (0: any scale, all digits 0)
  // 1 / s, a power of two (in fp64: 2^(22 - e) overflows fp32 for subnormal amax)
  const __m512d inv = _mm512_set1_pd(std::ldexp(1.0, kDigitBits - e));
  scale = std::ldexp(1.0, e - kDigitBits);
  const __m512i half = _mm512_set1_epi32(128), low = _mm512_set1_epi32(255);
  __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t k = 0; k < 4 * P; k += 16) {  // 4 quads a step
    const __m512 v = load16(x + k, K - k);   // (zeros past K; n <= 0 masks everything)
    // x / s exact in fp64, rounded to nearest even (the default MXCSR mode, as nearbyint)
    const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(
        _mm512_cvtps_pd(_mm512_castps512_ps256(v)), inv));
    const __m256i hi = _mm512_cvtpd_epi32(_mm512_mul_pd(
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))),
        inv));
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    alignas(16) int32_t bytes[3][4];
    for (int j = 0; j < 3; ++j) {  // balanced: q = digit + 256 rest, digit in [-128, 127]
      const __m512i digit = _mm512_sub_epi32(
          _mm512_and_si512(_mm512_add_epi32(q, half), low), half);
      sums[j] = _mm512_add_epi32(sums[j], digit);
      q = _mm512_srai_epi32(_mm512_sub_epi32(q, digit), 8);  // exact
      _mm_store_si128(reinterpret_cast<__m128i*>(bytes[j]), _mm512_cvtepi32_epi8(digit));
    }
    const int64_t p0 = k / 4, n = std::min<int64_t>(4, P - p0);
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < 3; ++j) quads[(p0 + i) * stride + j] = bytes[j][i];
  }
  // |D_j| <= 128 K: int32 lanes hold it for K <= 65536
  offset = 128 * (static_cast<int64_t>(_mm512_reduce_add_epi32(sums[0])) +
                  256 * static_cast<int64_t>(_mm512_reduce_add_epi32(sums[1])) +
                  65536 * static_cast<int64_t>(_mm512_reduce_add_epi32(sums[2])));
}

// acc + the dot products of w's unsigned bytes with *x's four signed bytes, broadcast from
// memory inside the instruction: written with _mm512_set1_epi32 GCC loads each of a tile's 24
// broadcasts into a register of its own and then spills the accumulators through the loop
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// 16 outputs of one token from its three digit sums: y = (sum_j 256^j acc_j - offset) s scale,
// the integer part exact in int64, the product in fp64, rounded once to fp32 and from there
// to Out. `rows` (<= 16) outputs are written and their scales read.
template <typename Out>
inline void store_block(const int32_t acc[3][kBlock], int64_t offset, double s,
                        const float* scale, Out* y, int64_t rows) {
  alignas(64) float out[kBlock];
  for (int half = 0; half < 2; ++half) {
    auto wide = [&](int j) {
      return _mm512_cvtepi32_epi64(_mm256_load_si256(
          reinterpret_cast<const __m256i*>(acc[j] + half * 8)));
    };
    __m512i dot = _mm512_add_epi64(wide(0), _mm512_slli_epi64(wide(1), 8));
    dot = _mm512_add_epi64(dot, _mm512_slli_epi64(wide(2), 16));
    dot = _mm512_sub_epi64(dot, _mm512_set1_epi64(offset));
    __m512d v = _mm512_mul_pd(_mm512_cvtepi64_pd(dot), _mm512_set1_pd(s));
    const int64_t valid = std::clamp<int64_t>(rows - half * 8, 0, 8);  // no read past n
    const __m256 sc = _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << valid) - 1),
                                            scale + half * 8);
    v = _mm512_mul_pd(v, _mm512_cvtps_pd(sc));
    _mm256_store_ps(out + half * 8, _mm512_cvtpd_ps(v));
  }
  for (int64_t r = 0; r < rows; ++r) y[r] = static_cast<Out>(out[r]);
}

// The MT tokens of one tile (quads x: [P][MT][3]; their offsets and scales) against NV
// consecutive blocks of packed weights w (each P lines of 64 bytes) with their row scales
// `scale`: y[m * ldy + 16 v + i] for the first `rows_left` outputs (the rest of the last
// block is padding). The first `lines` (<= P) 64-byte lines from `ahead` are fetched into L2,
// one per k-quad (panel: the next panel's weights).
template <int MT, int NV, typename Out>
inline void tile(const int32_t* x, const int64_t* offset, const double* xs, int64_t P,
                 const uint8_t* w, const float* scale, Out* y, int64_t ldy, int64_t rows_left,
                 const uint8_t* ahead = nullptr, int64_t lines = 0) {
  constexpr int A = MT * 3 * NV;  // accumulator (m, j, v) at (m * 3 + j) * NV + v
  __m512i acc[A];
#pragma GCC unroll 32
  for (int i = 0; i < A; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t p = 0; p < P; ++p, x += MT * 3) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + (v * P + p) * 64);
    if (p < lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 64), _MM_HINT_T1);
#pragma GCC unroll 32
    for (int i = 0; i < A; ++i) acc[i] = dpbusd_broadcast(acc[i], wv[i % NV], x + i / NV);
  }
  // out of registers once, by constant indices (indexing `acc` in the epilogue's loops would
  // make the compiler keep it in memory through the main loop)
  alignas(64) int32_t sums[MT][NV][3][kBlock];
#pragma GCC unroll 32
  for (int i = 0; i < A; ++i)
    _mm512_store_si512(sums[i / (3 * NV)][i % NV][(i / NV) % 3], acc[i]);
  for (int v = 0; v < NV; ++v) {
    const int64_t n = v * kBlock, rows = std::min<int64_t>(kBlock, rows_left - n);
    for (int m = 0; m < MT; ++m)
      store_block<Out>(sums[m][v], offset[m], xs[m], scale + n, y + m * ldy + n, rows);
  }
}

// One tile of MT tokens against `count` blocks: NV blocks per register tile, MT * 3 * NV
// accumulators + NV weight lines within 32 registers.
template <int MT, typename Out>
inline void token_tile(const int32_t* x, const int64_t* offset, const double* xs, int64_t P,
                       const uint8_t* w, int64_t count, const float* scale, Out* y,
                       int64_t ldy, int64_t rows_left, const uint8_t* ahead = nullptr,
                       int64_t lines = 0) {
  // one token (batch-1 decode): one block at a time, so the run's weights, laid end to end,
  // stream sequentially (as gemm_vnni.cpp's one-token case); a block's sums do not depend on NV
  constexpr int NV = MT == 1 ? 1 : (MT <= 2 ? 4 : (MT <= 4 ? 2 : 1));
  int64_t i = 0;
  // block i of the run: its weights, scales, outputs and the rows from it to the end; `lines`
  // ahead shared out over the register tiles (panel)
  const int64_t calls = (count + NV - 1) / NV;
  for (int64_t c = 0, done = 0; i + NV <= count; i += NV, ++c) {
    const int64_t upto = lines * (c + 1) / calls;
    tile<MT, NV, Out>(x, offset, xs, P, w + i * P * 64, scale + i * kBlock, y + i * kBlock, ldy,
                      rows_left - i * kBlock, ahead + done * 64, std::min(P, upto - done));
    done = upto;
  }
  for (; i < count; ++i)
    tile<MT, 1, Out>(x, offset, xs, P, w + i * P * 64, scale + i * kBlock, y + i * kBlock, ldy,
                     rows_left - i * kBlock);
}

// M tokens (digits from `quads`, laid out in tiles from token 0: see the top of this file;
// offsets and scales per token) against `count` consecutive blocks from w, every token tile
// over the same blocks in turn (they stay in cache between tiles): y [M, ldy] from column 0
// of the first block, `rows_left` outputs from there to the end of the projection. `next`:
// how many blocks after these the full 8-token tiles fetch into L2 as they go (at most one
// line per k-quad of each register tile), so the next panel's first tile finds them there.
template <typename Out>
inline void panel(const int32_t* quads, const int64_t* offset, const double* xs, int64_t M,
                  int64_t P, const uint8_t* w, int64_t count, const float* scale, Out* y,
                  int64_t ldy, int64_t rows_left, int64_t next = 0) {
  const uint8_t* ahead = w + count * P * 64;
  const int64_t lines = next * P, tiles = M / kTokenTile;
  for (int64_t m0 = 0, t = 0, done = 0; m0 < M; m0 += kTokenTile, ++t) {
    const int32_t* x = quads + 3 * P * m0;
    const int64_t* o = offset + m0;
    const double* s = xs + m0;
    Out* ym = y + m0 * ldy;
    // a full tile's share of the next panel's lines
    const int64_t upto = M - m0 >= kTokenTile ? lines * (t + 1) / tiles : done;
    switch (std::min(kTokenTile, M - m0)) {
      case 1: token_tile<1, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 2: token_tile<2, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 3: token_tile<3, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 4: token_tile<4, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 5: token_tile<5, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 6: token_tile<6, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      case 7: token_tile<7, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left); break;
      default:
        token_tile<8, Out>(x, o, s, P, w, count, scale, ym, ldy, rows_left, ahead + done * 64,
                           upto - done);
        break;
    }
    done = upto;
  }
}

}  // namespace int8_vnni
#endif

}  // namespace kiln
