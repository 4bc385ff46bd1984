// Prefill attention for long queries (bf16 with AVX512-BF16).
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
// Torch reference: TorchPagedAttention in kiln/runner/attention.py.

#include "ops.h"

namespace kiln {

namespace {

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
  // the row's max 16 lanes at a time (a scalar loop here was a fifth of the kernel's time at
  // 1,024 tokens)
  const float mx = max16(s, n);
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

}  // namespace

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

}  // namespace kiln
