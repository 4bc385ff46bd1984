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
// (gemm.cpp) spends 12 vector ops (sign-extend, convert, FMA per 16).
#include <atomic>

#include "ops.h"

namespace kiln {

namespace {

std::atomic<int64_t> g_int8_vnni_calls{0};  // kernel runs, read by tests (stack really used it)

constexpr int64_t kBlock = 16;      // output rows per block: one vector of int32 sums
constexpr int64_t kTokenTile = 8;   // tokens per tile (weights re-read from cache per tile)
constexpr int64_t kPanel = 4;       // blocks a thread runs every token tile over in turn
constexpr int kDigitBits = 22;      // |x_q| <= 2^22: three balanced base-256 digits hold it
constexpr int64_t kMaxK = 65536;    // 255 * 128 * K < 2^31

// The activations as digit quads, tile by tile so that one k-quad's broadcasts for a whole
// token tile are adjacent: [ceil(M/8)][P][8][3] int32 (4 digits each), tokens past M zero;
// plus, per token, the scale s and the offset correction 128 * (D0 + 256 D1 + 65536 D2).
struct Digits {
  std::vector<int32_t> quads;
  std::vector<double> scale;
  std::vector<int64_t> offset;
  int64_t P;

  const int32_t* tile(int64_t m0) const { return quads.data() + (m0 / kTokenTile) * P * 24; }
};

template <typename T>
Digits to_digits(const T* x, int64_t M, int64_t K, int64_t P) {
  const int64_t tiles = (M + kTokenTile - 1) / kTokenTile;
  Digits d{std::vector<int32_t>(tiles * P * 24, 0), std::vector<double>(M),
           std::vector<int64_t>(M), P};
  auto* bytes = reinterpret_cast<int8_t*>(d.quads.data());
  for (int64_t m = 0; m < M; ++m) {
    const T* xm = x + m * K;
    float amax = 0.f;
    bool finite = true;  // (std::max drops a NaN)
    for (int64_t k = 0; k < K; ++k) {
      const float v = f32(xm[k]);
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::abs(v));
    }
    if (!finite) {  // digits stay 0; the NaN scale makes the token's outputs NaN
      d.scale[m] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    int e = 0;
    std::frexp(amax, &e);  // amax < 2^e (0 for amax = 0: any scale, every digit is 0)
    // 1 / s, a power of two (in fp64: 2^(22 - e) overflows fp32 for subnormal amax)
    const double inv = std::ldexp(1.0, kDigitBits - e);
    d.scale[m] = std::ldexp(1.0, e - kDigitBits);
    const int64_t base = (m / kTokenTile) * P * 24 + (m % kTokenTile) * 3;  // in quads
    int64_t sums[3] = {0, 0, 0};
    for (int64_t k = 0; k < K; ++k) {
      int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<double>(f32(xm[k])) * inv));
      for (int j = 0; j < 3; ++j) {
        const int32_t digit = ((q + 128) & 255) - 128;  // balanced: q = digit + 256 * rest
        bytes[(base + (k / 4) * 24 + j) * 4 + k % 4] = static_cast<int8_t>(digit);
        sums[j] += digit;
        q = (q - digit) / 256;  // exact
      }
    }
    d.offset[m] = 128 * (sums[0] + 256 * sums[1] + 65536 * sums[2]);
  }
  return d;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool kHasVnni = true;

// acc + the dot products of w's unsigned bytes with *x's four signed bytes, broadcast from
// memory inside the instruction: written with _mm512_set1_epi32 GCC loads each of a tile's 24
// broadcasts into a register of its own and then spills the accumulators through the loop
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// 16 outputs of one token from its three digit sums: y = (sum_j 256^j acc_j - offset) s scale,
// the integer part exact in int64, the product in fp64, rounded once to Out.
template <typename Out>
void store_block(const int32_t acc[3][kBlock], int64_t offset, double s, const float* scale,
                 Out* y, int64_t rows) {
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

// Tokens [0, MT) of d against NV consecutive blocks (each P lines of 64 bytes) from block b.
template <int MT, int NV, typename Out>
void int8_vnni_tile(const Digits& d, int64_t m0, int64_t P, const uint8_t* w, int64_t b,
                    const float* scale, Out* y, int64_t N) {
  constexpr int A = MT * 3 * NV;  // accumulator (m, j, v) at (m * 3 + j) * NV + v
  __m512i acc[A];
#pragma GCC unroll 32
  for (int i = 0; i < A; ++i) acc[i] = _mm512_setzero_si512();
  const uint8_t* wb = w + b * P * 64;
  const int32_t* x = d.tile(m0);  // quad p of token m's digit j at x[p * 24 + m * 3 + j]
  for (int64_t p = 0; p < P; ++p, x += 24) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wb + (v * P + p) * 64);
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
    const int64_t n = (b + v) * kBlock, rows = std::min<int64_t>(kBlock, N - n);
    for (int m = 0; m < MT; ++m)
      store_block<Out>(sums[m][v], d.offset[m0 + m], d.scale[m0 + m], scale + n,
                       y + (m0 + m) * N + n, rows);
  }
}

// Tokens [m0, m0 + MT) against `count` blocks from block b: NV blocks per tile, MT * 3 * NV
// accumulators + NV weight lines within 32 registers.
template <int MT, typename Out>
void int8_vnni_token_tile(const Digits& d, int64_t m0, int64_t P, const uint8_t* w, int64_t b,
                          int64_t count, const float* scale, Out* y, int64_t N) {
  constexpr int NV = MT <= 2 ? 4 : (MT <= 4 ? 2 : 1);
  int64_t i = 0;
  for (; i + NV <= count; i += NV) int8_vnni_tile<MT, NV, Out>(d, m0, P, w, b + i, scale, y, N);
  for (; i < count; ++i) int8_vnni_tile<MT, 1, Out>(d, m0, P, w, b + i, scale, y, N);
}

template <typename Out>
void int8_vnni_panel(const Digits& d, int64_t M, int64_t P, const uint8_t* w, int64_t b,
                     int64_t count, const float* scale, Out* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kTokenTile) {  // the panel stays in L2 between tiles
    switch (std::min(kTokenTile, M - m0)) {
      case 1: int8_vnni_token_tile<1, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 2: int8_vnni_token_tile<2, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 3: int8_vnni_token_tile<3, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 4: int8_vnni_token_tile<4, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 5: int8_vnni_token_tile<5, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 6: int8_vnni_token_tile<6, Out>(d, m0, P, w, b, count, scale, y, N); break;
      case 7: int8_vnni_token_tile<7, Out>(d, m0, P, w, b, count, scale, y, N); break;
      default: int8_vnni_token_tile<8, Out>(d, m0, P, w, b, count, scale, y, N); break;
    }
  }
}

// Each thread takes one contiguous run of blocks (an even split: 36 blocks of a 576-row layer
// are 18 and 18, where panels of 4 would be 5 and 4), in panels of kPanel.
template <typename Out>
void int8_vnni_run(const Digits& d, int64_t M, int64_t P, const uint8_t* w, int64_t blocks,
                   const float* scale, Out* y, int64_t N) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kPanel)
      int8_vnni_panel<Out>(d, M, P, w, b, std::min(kPanel, end - b), scale, y, N);
  });
}
#else
constexpr bool kHasVnni = false;
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
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  ++g_int8_vnni_calls;
  const at::Tensor xc = x.contiguous();
  const at::Tensor sc = scale.reshape(-1).to(at::kFloat).contiguous();
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

int64_t int8_vnni_calls() { return g_int8_vnni_calls.load(); }

}  // namespace kiln
