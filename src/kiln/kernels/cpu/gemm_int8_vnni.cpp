// Weight-only int8 linears on AVX512-VNNI integer dot products, activations kept at ~fp32
// precision (not W8A8).
//
// Weight layout ("int8 VNNI-packed"): W int8 [N, K] is stored as uint8 [N/16][K/4][16][4],
// u = w + 128 (zero-padded with w = 0, i.e. 128): for each block of 16 output rows, the k-quads
// in order, the 16 rows' quads side by side (64 bytes). One `vpdpbusd` multiplies a 64-byte
// line by one broadcast quad of signed bytes and adds to 16 int32 sums, so a block streams
// from memory front to back as the bf16 layout does (gemm_vnni.cpp).
//
// Activations: per token, x_q = round(x / s) with s the power of two 2^(e - 22) where
// max|x| < 2^e, so |x_q| <= 2^22 and x / s is exact: a bf16 (or widened bf16) element of at
// least 2^(e - 15) loses nothing, having 8 significant bits. x_q is split into three balanced
// signed base-256 digits d0 + 256 d1 + 65536 d2, each in [-128, 127]. Per digit j, one
// vpdpbusd per quad: acc_j = sum_k u[n, k] d_j[k]; the offset comes off per token:
// sum_k w d_j = acc_j - 128 D_j (D_j = sum_k d_j[k]). The combination is exact in int64:
// dot = sum_j 256^j (acc_j - 128 D_j) = sum_k w[n, k] x_q[k] (|dot| < 2^45: exact in fp64
// too), then y = dot * s * scale[n] in fp64, rounded to fp32 (and from there to x's dtype for
// bf16/fp16 outputs). Error against the torch reference x.double() @ (w * scale).double().T:
// |y - ref| <= scale[n] s/2 sum_k |w[n, k]| plus those roundings. int32 sums: |acc_j| <=
// 255 * 128 * K, so K <= 65,536 (checked).
//
// Every output is the same integer sum whatever M, the tile or the thread count: a token's
// result does not depend on its batch. 3 vpdpbusd per 64 weights per token, where int8_gemv
// (gemm.cpp) spends 12 vector ops (sign-extend, convert, FMA per 16). The digit split and the
// register tiles live in int8_vnni_tile.h, shared with the fused experts (moe.cpp).
#include <atomic>

#include <ATen/ops/constant_pad_nd.h>

#include "int8_vnni_tile.h"
#include "ops.h"
#include "vnni_tile.h"

namespace kiln {

namespace {

std::atomic<int64_t> g_int8_vnni_calls{0};  // kernel runs, read by tests (stack really used it)

#if KILN_INT8_VNNI
constexpr bool kHasVnni = true;
using int8_vnni::kMaxK;
constexpr int64_t kPanel = 4;  // blocks a thread runs every token tile over in turn

// The activations as digit quads (int8_vnni_tile.h: tiles of 8 tokens, [P][w][3] int32
// each), and per token the scale s and the offset correction 128 (D0 + 256 D1 + 65536 D2).
struct Digits {
  std::vector<int32_t> quads;
  std::vector<double> scale;
  std::vector<int64_t> offset;
};

template <typename T>
Digits to_digits(const T* x, int64_t M, int64_t K, int64_t P) {
  Digits d{std::vector<int32_t>(M * P * 3), std::vector<double>(M), std::vector<int64_t>(M)};
  for (int64_t m = 0; m < M; ++m) {
    const int8_vnni::TokenSlot where = int8_vnni::token_slot(m, M, P);
    int8_vnni::token_digits(x + m * K, K, P, d.quads.data() + where.base, where.stride,
                            d.scale[m], d.offset[m]);
  }
  return d;
}

// Each thread takes one contiguous run of blocks (an even split: 36 blocks of a 576-row layer
// are 18 and 18, where panels of 4 would be 5 and 4), in panels of kPanel over which every
// token tile passes in turn (a panel's weights come from memory once per call).
template <typename Out>
void int8_vnni_run(const Digits& d, int64_t M, int64_t P, const uint8_t* w, int64_t blocks,
                   const float* scale, Out* y, int64_t N) {
  // each panel's full 8-token tiles fetch the next panel of the thread's run into L2 as they
  // go, as the bf16 GEMM's do (decision 0023): the default model's int8 GEMMs and LM head, 2
  // threads on Zen 4, alternated in one process, medians of 6: 64 tokens 69.7 -> 68.9 ms, 16
  // tokens 19.9 -> 19.0 ms (every pair ahead); the same sums
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kPanel)
      int8_vnni::panel<Out>(d.quads.data(), d.offset.data(), d.scale.data(), M, P,
                            w + b * P * 64, std::min(kPanel, end - b),
                            scale + b * int8_vnni::kBlock, y + b * int8_vnni::kBlock, N,
                            N - b * int8_vnni::kBlock,
                            std::clamp<int64_t>(end - b - kPanel, 0, kPanel));
  });
}
#else
constexpr bool kHasVnni = false;
constexpr int64_t kMaxK = 65536;
#endif

// From this many bf16 tokens on, the codes are widened to bf16 (below); 0 = never. Set per
// CPU from kernel_tuning() (`set_int8_wide_min_tokens`).
std::atomic<int64_t> g_wide_min_tokens{0};

#if KILN_INT8_VNNI && defined(__AVX512BF16__)
constexpr bool kHasWide = true;
constexpr int64_t kWidePanel = 3;  // blocks per panel: 8-token tiles x 3 blocks of accumulators

// Many bf16 tokens: a thread widens a panel of kWidePanel blocks of codes to bf16 in the
// bf16 VNNI layout (gemm_vnni.cpp) once, into a buffer that stays in L2, and runs the bf16
// GEMM's register tiles over it for every token tile, the per-row scale applied to the fp32
// sums. A code w in [-128, 127] is exact in bf16 and so is each product with a bf16 x, so
// y = round(scale[n] * sum_k x[k] w[n, k]) with the sum in fp32, as x.float() @ w.float().T
// scaled: 2 bf16 dot products per 64 weights per token against the digits' 3, the widening
// (~18 vector ops per 64 weights) paid once per call. Quad line p of a block becomes the
// bf16 pair lines 2p and 2p + 1 (k-quad 4p..4p+3 of each of the 16 rows).
inline void widen_block(const uint8_t* w, int64_t P4, at::BFloat16* out) {
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  auto* o = reinterpret_cast<__m512i*>(out);
  for (int64_t p = 0; p < P4; ++p) {
    const __m512i s = _mm512_xor_si512(_mm512_loadu_si512(w + p * 64), flip);  // signed codes
    // each code as fp32 (exact), the bf16 of it being its high half
    const __m512i f0 = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 24), 24)));
    const __m512i f1 = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 16), 24)));
    const __m512i f2 = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 8), 24)));
    const __m512i f3 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(s, 24)));
    // lane i: (k even) in the low half, (k odd) in the high half: (f1 & high) | (f0 >> 16)
    _mm512_storeu_si512(o + 2 * p,
                        _mm512_ternarylogic_epi32(high, f1, _mm512_srli_epi32(f0, 16), 0xEA));
    _mm512_storeu_si512(o + 2 * p + 1,
                        _mm512_ternarylogic_epi32(high, f3, _mm512_srli_epi32(f2, 16), 0xEA));
  }
}

template <typename Out>
void int8_wide_run(const int32_t* x, int64_t M, int64_t P4, const uint8_t* w, int64_t blocks,
                   const float* scale, Out* y, int64_t N) {
  const int64_t P = 2 * P4;  // bf16 pairs per token and block line count of the widened panel
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<at::BFloat16> panel;  // the thread's widened panel, kept
    const size_t need = kWidePanel * P * 2 * vnni::kBlock;
    if (panel.size() < need) panel.resize(need);
    for (int64_t b = begin; b < end; b += kWidePanel) {
      const int64_t nv = std::min(kWidePanel, end - b);
      for (int64_t v = 0; v < nv; ++v)
        widen_block(w + (b + v) * P4 * 64, P4, panel.data() + v * P * 2 * vnni::kBlock);
      const int64_t n0 = b * vnni::kBlock;
      // the 8-token tiles fetch the next panel's codes into L2 as they go (0023's fetch)
      const auto* next = reinterpret_cast<const char*>(w + (b + nv) * P4 * 64);
      const int64_t lines = std::min(kWidePanel, end - b - nv) * P4;
      if (nv == 3)
        vnni::vnni_panel_at<3, Out>(x, M, P, panel.data(), n0, y, N, next, lines, scale);
      else if (nv == 2)
        vnni::vnni_panel_at<2, Out>(x, M, P, panel.data(), n0, y, N, next, lines, scale);
      else
        vnni::vnni_panel_at<1, Out>(x, M, P, panel.data(), n0, y, N, next, lines, scale);
    }
  });
}
#else
constexpr bool kHasWide = false;
#endif

}  // namespace

at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                        int64_t n, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && at::isFloatingType(x.scalar_type()),
              "int8_vnni_mm: x must be float [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 &&
                  w.scalar_type() == at::kByte && w.is_contiguous(),
              "int8_vnni_mm: w must be int8-VNNI-packed uint8 [N/16, K/4, 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(1), blocks = w.size(0);
  TORCH_CHECK(P == (K + 3) / 4, "int8_vnni_mm: x has ", K, " features, w packs ", 4 * P);
  TORCH_CHECK(4 * P <= kMaxK, "int8_vnni_mm: ", K, " input features exceed ", kMaxK,
              " (the int32 sums 255 * 128 * K would overflow)");
  TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "int8_vnni_mm: ", n,
              " outputs do not fit ", blocks, " blocks of 16");
  TORCH_CHECK(scale.numel() == n, "int8_vnni_mm: ", scale.numel(), " scales for ", n, " rows");
  TORCH_CHECK(kHasVnni, "int8_vnni_mm: this build has no AVX512-VNNI (check int8_vnni_available)");
  const at::ScalarType out_type = fp32_out ? at::kFloat : x.scalar_type();
  auto y = at::empty({M, n}, x.options().dtype(out_type));
  if (M == 0) return y;
#if KILN_INT8_VNNI
  ++g_int8_vnni_calls;
  const at::Tensor xc = x.contiguous();
  const at::Tensor sc = scale.reshape(-1).to(at::kFloat).contiguous();
#if defined(__AVX512BF16__)
  const int64_t wide = g_wide_min_tokens.load(std::memory_order_relaxed);
  if (wide > 0 && M >= wide && xc.scalar_type() == at::kBFloat16) {
    // x as bf16 pairs, zero-padded to the packed quads (padding codes are 0 too)
    const at::Tensor xp = 4 * P > K ? at::constant_pad_nd(xc, {0, 4 * P - K}) : xc;
    const auto* x32 = reinterpret_cast<const int32_t*>(xp.data_ptr<at::BFloat16>());
    if (fp32_out)
      int8_wide_run<float>(x32, M, P, w.data_ptr<uint8_t>(), blocks, sc.data_ptr<float>(),
                           y.data_ptr<float>(), n);
    else
      int8_wide_run<at::BFloat16>(x32, M, P, w.data_ptr<uint8_t>(), blocks,
                                  sc.data_ptr<float>(), y.data_ptr<at::BFloat16>(), n);
    return y;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "int8_vnni_mm",
                                  [&] {
    const Digits d = to_digits(xc.data_ptr<scalar_t>(), M, K, P);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (fp32_out)
      int8_vnni_run<float>(d, M, P, wp, blocks, sc.data_ptr<float>(), y.data_ptr<float>(), n);
    else
      int8_vnni_run<scalar_t>(d, M, P, wp, blocks, sc.data_ptr<float>(),
                              y.data_ptr<scalar_t>(), n);
  });
#endif
  return y;
}

bool int8_vnni_available() { return kHasVnni; }

int64_t set_int8_wide_min_tokens(int64_t tokens) {
  TORCH_CHECK(tokens >= 0, "set_int8_wide_min_tokens: ", tokens,
              " tokens: expected 0 (off) or more");
  return kHasWide ? g_wide_min_tokens.exchange(tokens) : 0;
}

int64_t int8_vnni_calls() { return g_int8_vnni_calls.load(); }

}  // namespace kiln
