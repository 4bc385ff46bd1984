// bf16 linears on weights packed for the AVX512-BF16 dot-product instruction, at every M.
//
// Layout ("VNNI-packed"): W [N, K] is stored as [N / 16][K / 2][16][2]: for each block of 16
// output rows, the k-pairs in order, each pair of the 16 rows side by side (64 bytes). One
// `vdpbf16ps` multiplies a 64-byte line of that layout by one broadcast pair of x and adds to
// 16 outputs at once, so a block streams from memory as one sequential run (a GEMV reads the
// weights front to back; the row-major kernels keep 16 rows in flight and reached ~0.6 of the
// bandwidth here) and no horizontal sums are needed. Tiles of up to 8 tokens x 4 blocks keep
// their accumulators in registers; the same tiles serve decode (bandwidth) and prefill
// (compute). Torch reference: x.float() @ W.float().T (each product exact in fp32, summed in
// fp32), rounded once to bf16 or written as fp32.
//
// Every output is the sum over k-pairs in order, from zero, of the same instruction: a token's
// result does not depend on M, the tile or the thread count (batch invariance, tested).
#include <ATen/ops/constant_pad_nd.h>

#include "ops.h"
#include "vnni_tile.h"

namespace kiln {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {

using vnni::vnni_panel;

// Each thread takes one contiguous run of blocks (an even split: the 36 blocks of a 576-row
// layer are 18 and 18, where whole panels of 4 were 5 and 4 and one thread waited for the
// other), in panels of NV blocks, the run's last panel narrower.
template <int NV, typename Out>
void vnni_mm(const int32_t* x, int64_t M, int64_t P, const at::BFloat16* w, int64_t blocks,
             Out* y, int64_t N) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (; b + NV <= end; b += NV)  // fetching ahead the next panel of this thread's run
      vnni_panel<NV, Out>(x, M, P, w, b, y, N, std::min<int64_t>(NV, end - b - NV));
    if (end - b == 1) {
      vnni_panel<1, Out>(x, M, P, w, b, y, N);
    } else if (end - b == 2) {
      vnni_panel<2, Out>(x, M, P, w, b, y, N);
    } else if (end - b == 3) {
      vnni_panel<3, Out>(x, M, P, w, b, y, N);
    }
  });
}

template <typename Out>
void vnni_dispatch(const int32_t* x, int64_t M, int64_t P, const at::BFloat16* w,
                   int64_t blocks, Out* y, int64_t N) {
  // One token (batch-1 decode) reads one block at a time: a thread's blocks lie end to end,
  // so its weights arrive as one sequential stream, where panels of 4 read 4 streams a block
  // apart (the decoder's 120 GEMVs in a chain: 28 -> 31-32 GB/s, the rate of a plain read).
  // 4 blocks per panel while tiles are at most 4 tokens (verify); 3 from 8 tokens, where an
  // 8-token tile needs 24 accumulators
  if (M == 1) return vnni_mm<1, Out>(x, M, P, w, blocks, y, N);
  if (M < 8) return vnni_mm<4, Out>(x, M, P, w, blocks, y, N);
  vnni_mm<3, Out>(x, M, P, w, blocks, y, N);
}

}  // namespace
#endif

at::Tensor bf16_vnni_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_vnni_mm: x must be bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 &&
                  w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "bf16_vnni_mm: w must be VNNI-packed bfloat16 [N/16, K/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(1), blocks = w.size(0);
  TORCH_CHECK(P == (K + 1) / 2, "bf16_vnni_mm: x has ", K, " features, w packs ", 2 * P);
  TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "bf16_vnni_mm: ", n,
              " outputs do not fit ", blocks, " blocks of 16");
  auto y = at::empty({M, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  at::Tensor xc = x.contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});  // the last pair's second half: zero
  const auto* xp = reinterpret_cast<const int32_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = w.data_ptr<at::BFloat16>();
  if (M == 0) return y;
  if (fp32_out)
    vnni_dispatch<float>(xp, M, P, wp, blocks, y.data_ptr<float>(), n);
  else
    vnni_dispatch<at::BFloat16>(xp, M, P, wp, blocks, y.data_ptr<at::BFloat16>(), n);
  return y;
#else
  TORCH_CHECK(false, "bf16_vnni_mm: this build has no AVX512-BF16 (check bf16_vnni_available)");
  return y;
#endif
}

int64_t set_vnni_stream_ahead(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (1 << 20), "set_vnni_stream_ahead: ", bytes,
              " bytes: expected 0 (off) to 1 MiB");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return vnni::g_stream_ahead.exchange(bytes);
#else
  return 0;
#endif
}

bool bf16_vnni_available() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

}  // namespace kiln
