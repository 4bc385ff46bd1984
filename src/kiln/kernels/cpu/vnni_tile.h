// The register tiles of kiln's VNNI-packed bf16 matmul (layout and torch reference: the header
// of gemm_vnni.cpp), shared by the dense linears (gemm_vnni.cpp) and the fused experts
// (moe.cpp), so an expert's rows are summed exactly as its own linear would sum them.
#pragma once

#include <atomic>

#include "common.h"

namespace kiln {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace vnni {

inline constexpr int64_t kBlock = 16;  // output rows per block: one 512-bit vector of fp32 sums
// From 8 to this many tokens a panel's tiles fetch the next panel's weights into L2 (vnni_panel's
// `next`). A decode step's weights come from memory: each panel's first 8-token tile waited on
// them, the others found them in L2. The default model's 120 GEMMs and LM head at 64 tokens, 2
// threads on Zen 4: 45.7-49.4 -> 43.4-46.2 ms (16 tokens: 17.4-18.9 -> 16.3-16.9); 64 x 128/128
// offline 602 -> 621 tok/s (alternated in one process, medians of 6). At 1,024 tokens a panel
// serves 128 tiles and the fetch was within the noise (decision 0023).
inline constexpr int64_t kFetchAheadMaxTokens = 256;

// One token (batch-1 decode): each k-pair's line this many bytes ahead of the one being read is
// prefetched with the non-temporal hint, 0 = none; set per CPU from kernel_tuning()
// (`set_vnni_stream_ahead`). The default model's decode at batch 1 on Zen 5, alternated in one
// process: 159.3 -> 173.0 tok/s at 4,096 bytes, where T0 at the same distance gained nothing
// (decision 0024). Sums unchanged.
inline std::atomic<int64_t> g_stream_ahead{0};

// y[m, n0 + 16 v + i] for m < MT, v < NV: x rows of P int32 (bf16 pairs), `blocks` NV blocks
// of the packed weight (each P * 32 bf16), the block's valid rows `valid` (16 except in the
// last block of N % 16 != 0). With `ahead`, the first `lines` (<= P) 64-byte lines from there
// are fetched into L2, one per k-pair (vnni_panel: the next panel's weights). With `stream`,
// each k-pair's line from there is fetched with the non-temporal hint (one token's stream).
// With `scale`, each fp32 sum is multiplied by scale[n] (one rounding) before it is stored
// (int8 codes widened to bf16: gemm_int8_vnni.cpp).
template <int MT, int NV, typename Out>
inline void vnni_tile(const int32_t* x, int64_t P, const at::BFloat16* w, Out* y, int64_t N,
                      int64_t n0, const char* ahead = nullptr, int64_t lines = 0,
                      const char* stream = nullptr, const float* scale = nullptr) {
  __m512 acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t stride = P * 2 * kBlock;
  for (int64_t p = 0; p < P; ++p) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + v * stride + p * 2 * kBlock);
    if (p < lines) _mm_prefetch(ahead + p * 64, _MM_HINT_T1);
    if (stream) _mm_prefetch(stream + p * 64, _MM_HINT_NTA);
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(x[m * P + p]);
      for (int v = 0; v < NV; ++v)
        acc[m][v] = _mm512_dpbf16_ps(acc[m][v], as_bh(wv[v]), as_bh(xb));
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * kBlock;
    const int64_t rows = std::min<int64_t>(kBlock, N - n);
    const __mmask16 mask = rows >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    if (scale) {
      const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n);
      for (int m = 0; m < MT; ++m) acc[m][v] = _mm512_mul_ps(acc[m][v], s);
    }
    for (int m = 0; m < MT; ++m) {
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(y + m * N + n, mask, acc[m][v]);
      } else {  // round to nearest even, as torch's float -> bfloat16
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[m][v]);
        _mm256_mask_storeu_epi16(y + m * N + n, mask, h);
      }
    }
  }
}

// Every token tile of x against NV blocks whose first is `wb`, the output rows from n0 on.
// Its 8-token tiles fetch `ahead_lines` 64-byte lines from `ahead` into L2 as they go, up to
// kFetchAheadMaxTokens tokens (shared out over the tiles, at most one line per k-pair), so the
// next panel's first tile finds its weights there rather than waiting on memory; the sums are
// the same either way. One token reads one block at a time (NV 1): its tile streams the weights
// `g_stream_ahead` bytes ahead. `scale`: vnni_tile's.
template <int NV, typename Out>
inline void vnni_panel_at(const int32_t* x, int64_t M, int64_t P, const at::BFloat16* wb,
                          int64_t n0, Out* y, int64_t N, const char* ahead = nullptr,
                          int64_t ahead_lines = 0, const float* scale = nullptr) {
  int64_t m = 0;
  if constexpr (NV <= 3) {  // 8 x 3 accumulators + 3 weights + 1 broadcast of 32 registers
    const int64_t lines = M <= kFetchAheadMaxTokens ? ahead_lines : 0, tiles = M / 8;
    for (int64_t i = 0, done = 0; m + 8 <= M; m += 8, ++i) {
      const int64_t upto = lines * (i + 1) / tiles;
      vnni_tile<8, NV>(x + m * P, P, wb, y + m * N, N, n0, ahead + done * 64,
                       std::min(P, upto - done), nullptr, scale);
      done = upto;
    }
  }
  for (; m + 4 <= M; m += 4)
    vnni_tile<4, NV>(x + m * P, P, wb, y + m * N, N, n0, nullptr, 0, nullptr, scale);
  if (m + 2 <= M) {
    vnni_tile<2, NV>(x + m * P, P, wb, y + m * N, N, n0, nullptr, 0, nullptr, scale);
    m += 2;
  }
  if (m < M) {
    const int64_t stream = M == 1 && NV == 1 ? g_stream_ahead.load(std::memory_order_relaxed) : 0;
    vnni_tile<1, NV>(x + m * P, P, wb, y + m * N, N, n0, nullptr, 0,
                     stream ? reinterpret_cast<const char*>(wb) + stream : nullptr, scale);
  }
}

// vnni_panel_at for the NV blocks from block b of the packed weight w, fetching the `next`
// blocks after them (a block is P lines of 64 bytes).
template <int NV, typename Out>
inline void vnni_panel(const int32_t* x, int64_t M, int64_t P, const at::BFloat16* w, int64_t b,
                       Out* y, int64_t N, int64_t next = 0) {
  const at::BFloat16* wb = w + b * P * 2 * kBlock;
  vnni_panel_at<NV, Out>(x, M, P, wb, b * kBlock, y, N,
                         reinterpret_cast<const char*>(wb + NV * P * 2 * kBlock), next * P);
}
}  // namespace vnni
#endif

}  // namespace kiln
