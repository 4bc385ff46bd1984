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

#include "int8_vnni_tile.h"
#include "ops.h"

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
