#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
// VNNI-packed: [N/16 blocks][K/2 pairs][16 rows][2] bf16
at::Tensor pack_vnni(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  return w.view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}
static inline __m512bh bh(__m512i v) { return (__m512bh)v; }
template <int MT, int NV>
inline void tile(const int32_t* x, int64_t xs, const at::BFloat16* w, int64_t bstride, int64_t P,
                 float* y, int64_t N, int64_t n0) {
  __m512 acc[MT][NV];
  for (int m = 0; m < MT; ++m) for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + v * bstride + p * 32);
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(x[m * xs + p]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], bh(wv[v]), bh(xb));
    }
  }
  for (int m = 0; m < MT; ++m) for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + m * N + n0 + v * 16, acc[m][v]);
}
template <int NV>
void panel(const int32_t* x, int64_t M, int64_t P, const at::BFloat16* w, int64_t b, float* y, int64_t N) {
  const int64_t bstride = P * 32; const at::BFloat16* wb = w + b * bstride; const int64_t n0 = b * 16;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile<8, NV>(x + m * P, P, wb, bstride, P, y + m * N, N, n0);
  if (m + 4 <= M) { tile<4, NV>(x + m * P, P, wb, bstride, P, y + m * N, N, n0); m += 4; }
  if (m + 2 <= M) { tile<2, NV>(x + m * P, P, wb, bstride, P, y + m * N, N, n0); m += 2; }
  if (m < M) tile<1, NV>(x + m * P, P, wb, bstride, P, y + m * N, N, n0);
}
template <int NV>
at::Tensor mm(const at::Tensor& x, const at::Tensor& wp) {
  const int64_t nb = wp.size(0), P = wp.size(1), N = nb * 16, M = x.size(0);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const at::BFloat16* w = wp.data_ptr<at::BFloat16>(); float* yp = y.data_ptr<float>();
  const int64_t panels = nb / NV;
  at::parallel_for(0, panels, 1, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) panel<NV>(xp, M, P, w, i * NV, yp, N);
  });
  return y;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_vnni", &pack_vnni);
  m.def("mm1", &mm<1>); m.def("mm2", &mm<2>); m.def("mm3", &mm<3>); m.def("mm4", &mm<4>);
}
