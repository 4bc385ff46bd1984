// Paged attention for sequences with short queries (decodes, draft verification).
// q: [T, Hq, D] (row-strided view ok); caches: [slots, Hkv, D]; out: [T, Hq * D].
// Sequence s owns flat tokens [query_start[s], query_start[s] + query_lens[s]); token i sits at
// position context_lens[s] + i and attends to keys at positions <= its own. With `tree` (one
// int64 per flat token, or null), a token whose entry m is nonzero attends instead, among its
// sequence's query tokens, to those j with bit j of m set (a draft tree: its ancestors and
// itself), and to every context key as before.
// One task per (sequence, kv head): the group's query heads share each K/V row read.
// Torch reference: TorchPagedAttention in kiln/runner/attention.py.

#include "ops.h"

namespace kiln {

namespace {

// Vector helpers: fp32 dot and axpy against a row stored in T (bf16, fp16 or fp32).
// AVX-512 when the head dim is a multiple of 16, a scalar loop otherwise.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; x += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + x), load16(k + x), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t x = 0; x < d; ++x) acc += q[x] * f32(k[x]);
  return acc;
}

template <typename T>
inline void axpy_row(float* a, float w, const T* v, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) if (d % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t x = 0; x < d; x += 16)
      _mm512_storeu_ps(a + x, _mm512_fmadd_ps(wv, load16(v + x), _mm512_loadu_ps(a + x)));
    return;
  }
#endif
  for (int64_t x = 0; x < d; ++x) a[x] += w * f32(v[x]);
}

#if defined(__AVX512F__)
// Load one byte of every cache line of a sequence's K and V rows before computing on them:
// `width` elements of each slot's row (`row` elements, every kv head) from kc and vc (offset to
// the first head a job reads, so a job reads ahead its own heads only). The loads are
// independent, so the core keeps many misses in flight; inside the compute loops each line's
// miss waits behind the work on the line before. Measured at batch 64, 150-token contexts,
// from DRAM: 1.32 -> 0.70 ms per layer; software prefetch hints to the same lines changed
// nothing on this CPU. At batch 1 (a job per kv head and slice of its query heads), reading
// ahead a job's head rather than the whole row: 30 layers at 328 keys from DRAM 1.66-1.69 ->
// 1.47-1.51 ms; without any read-ahead 1.51-1.59.
template <typename T>
inline void touch_rows(const T* kc, const T* vc, const int64_t* table, int64_t nk, int64_t row,
                       int64_t width, int64_t block_size) {
  int sink = 0;
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T));
  const int64_t step = row * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b * block_size < nk; ++b) {  // block by block: no division per key
    const int64_t n = std::min(block_size, nk - b * block_size);
    const auto* k = reinterpret_cast<const char*>(kc + table[b] * block_size * row);
    const auto* v = reinterpret_cast<const char*>(vc + table[b] * block_size * row);
    for (int64_t j = 0; j < n; ++j, k += step, v += step)
      for (int64_t x = 0; x < bytes; x += 64) sink += k[x] + v[x];
  }
  asm volatile("" : : "r"(sink));  // keeps the loads from being optimized away
}

#endif

#if defined(__AVX512BF16__)
// Lane i of the result = the sum of a[i]'s 16 lanes (three rounds of pairwise interleaved adds).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[r, 16 chunk + i] = scale * (q[r] . K[i]) for bf16 rows q [rows, D] and n <= 16 keys
// whose rows start at `keys`, `stride` elements apart: each key row is read contiguously,
// multiplied pairwise with vdpbf16ps (exact products, fp32 sums), and the 16 keys' partial
// sums are reduced together.
template <int D>
inline void score_keys(const uint16_t* q, int64_t rows, const at::BFloat16* keys,
                       int64_t stride, int64_t n, float* scores, int64_t ld, __m512 scale) {
  constexpr int C = D / 32;
  for (int64_t r = 0; r < rows; ++r) {
    __m512i qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(q + r * D + c * 32);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = _mm512_setzero_ps();
      if (i < n)
        for (int c = 0; c < C; ++c)
          a[i] = _mm512_dpbf16_ps(a[i], as_bh(qv[c]),
                                  as_bh(_mm512_loadu_si512(keys + i * stride + c * 32)));
    }
    _mm512_mask_storeu_ps(scores + r * ld, static_cast<__mmask16>((1u << n) - 1),
                          _mm512_mul_ps(reduce16(a), scale));
  }
}
#endif

// scores[r, j] = qf[r] . K[j] for every row r and key j of one kv head.
// For bf16 caches with AVX-512, 16 keys of one block at a time: each gather fetches a pair
// of adjacent bf16 values from 16 key rows, so the keys sit in the lanes and the rows
// accumulate with broadcast-FMAs, with no horizontal reductions.
template <typename T>
void key_scores(const float* qf, const T* kc, const int64_t* table, float* scores,
                int64_t rows, int64_t nk, int64_t kvh, int64_t hkv, int64_t d,
                int64_t block_size) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d % 2 == 0 && rows <= 32) {
      const int64_t stride = hkv * d;  // elements between consecutive slots' rows
      const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                              6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(stride)));
      const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      __m512 acc[32];
      for (int64_t j0 = 0; j0 < nk;) {
        const int64_t in_block = block_size - j0 % block_size;
        const int64_t n = std::min<int64_t>({16, in_block, nk - j0});
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
        const T* base = kc + slot * stride + kvh * d;
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x += 2) {
          const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx,
                                                           base + x, 2);
          const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
          const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(pair, hi_mask));
          for (int64_t r = 0; r < rows; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + x]), lo, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + x + 1]), hi, acc[r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(scores + r * nk + j0, mask, acc[r]);
        j0 += n;
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const T* krow = kc + (slot * hkv + kvh) * d;
    for (int64_t r = 0; r < rows; ++r) scores[r * nk + j] = dot_row(qf + r * d, krow, d);
  }
}

// acc[r] = sum_j p[r, j] V[j] for every row r of one kv head. With AVX-512, fp32 accumulators
// for up to 4 rows of a 64-wide head (2 of a 128-wide one) stay in registers across all keys:
// one flat loop over the keys, a block's first row looked up as the loop reaches it. (Nested
// loops, blocks then their keys, made GCC 12 store every accumulator of 3 or more rows to the
// stack on every key. With the block-wise read-ahead, batch 64 at 192 keys, 30 layers: from
// memory 25.7 -> 23.0 ms, from cache 15.2 -> 11.6 ms; benchmarks/experiments/attention_ab.py.)
#if defined(__AVX512F__)
template <int ROWS, int CHUNKS, typename T>
void weighted_values_regs(const float* p, const T* vc, const int64_t* table, float* acc,
                          int64_t nk, int64_t kvh, int64_t hkv, int64_t block_size) {
  constexpr int64_t d = CHUNKS * 16;
  __m512 a[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_setzero_ps();
  const int64_t step = hkv * d;  // elements between consecutive slots' rows
  const T* vrow = nullptr;
  int64_t left = 0;  // rows left in the current block
  for (int64_t j = 0; j < nk; ++j) {
    if (left == 0) {
      const int64_t b = j / block_size, off = j - b * block_size;
      vrow = vc + ((table[b] * block_size + off) * hkv + kvh) * d;
      left = block_size - off;
    }
    __m512 v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = load16(vrow + c * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * nk + j]);
      for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
    }
    vrow += step;
    --left;
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + r * d + c * 16, a[r][c]);
}

template <int CHUNKS, typename T>
void weighted_values_rows(const float* p, const T* vc, const int64_t* table, float* acc,
                          int64_t rows, int64_t nk, int64_t kvh, int64_t hkv,
                          int64_t block_size) {
  constexpr int64_t d = CHUNKS * 16;
  constexpr int R = CHUNKS == 4 ? 4 : 2;  // R x CHUNKS accumulators + CHUNKS values: <= 32
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R)
    weighted_values_regs<R, CHUNKS>(p + r0 * nk, vc, table, acc + r0 * d, nk, kvh, hkv, block_size);
  const float* pr = p + r0 * nk;
  float* ar = acc + r0 * d;
  switch (rows - r0) {  // the rest in one pass over the values
    case 3: weighted_values_regs<3, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    case 2: weighted_values_regs<2, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    case 1: weighted_values_regs<1, CHUNKS>(pr, vc, table, ar, nk, kvh, hkv, block_size); break;
    default: break;
  }
}
#endif

template <typename T>
void weighted_values(const float* p, const T* vc, const int64_t* table, float* acc,
                     int64_t rows, int64_t nk, int64_t kvh, int64_t hkv, int64_t d,
                     int64_t block_size) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (d == 64 || d == 128) {
      if (d == 64) weighted_values_rows<4>(p, vc, table, acc, rows, nk, kvh, hkv, block_size);
      else weighted_values_rows<8>(p, vc, table, acc, rows, nk, kvh, hkv, block_size);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const T* vrow = vc + (slot * hkv + kvh) * d;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = p[r * nk + j];
      if (w != 0.f) axpy_row(acc + r * d, w, vrow, d);
    }
  }
}

inline void softmax_row(float* s, int64_t n) {
  const float mx = *std::max_element(s, s + n);
  exp_shifted(s, s, n, mx);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += s[j];
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// Mask the scores of query tokens [t0, t0 + nq) against their own block's keys ctx + 1 .. :
// causal, or by each token's tree bits (see paged_attention). rows = nq * group, row stride nk.
// The tokens are the sequence's query tokens i0 .. i0 + nq - 1 (a job may take part of them).
inline void mask_query_block(float* scores, const int64_t* tree, int64_t t0, int64_t nq,
                             int64_t ctx, int64_t nk, int64_t group, int64_t i0 = 0) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t m = tree ? tree[t0 + i] : 0;
    for (int64_t j = ctx + 1; j < nk; ++j) {
      const bool visible = m ? ((m >> (j - ctx)) & 1) != 0 : j - ctx <= i0 + i;
      if (!visible)
        for (int64_t g = 0; g < group; ++g) scores[(i * group + g) * nk + j] = neg_inf;
    }
  }
}

template <typename T>
void attend_one(const T* qp, const T* kc, const T* vc, T* op, const int64_t* table,
                int64_t t0, int64_t nq, int64_t ctx, int64_t kvh, int64_t hkv, int64_t group,
                int64_t d, int64_t q_row, int64_t q_head, int64_t block_size, float scale,
                const int64_t* tree, std::vector<float>& qf, std::vector<float>& scores,
                std::vector<float>& acc) {
  const int64_t nk = ctx + nq, rows = nq * group, hq = hkv * group;
  scores.resize(rows * nk);
  qf.resize(rows * d);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = qp + (t0 + i) * q_row + (kvh * group + g) * q_head;
      float* dst = qf.data() + (i * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = f32(src[x]) * scale;
    }
  key_scores(qf.data(), kc, table, scores.data(), rows, nk, kvh, hkv, d, block_size);
  mask_query_block(scores.data(), tree, t0, nq, ctx, nk, group);
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * nk, nk);
  acc.assign(rows * d, 0.f);
  weighted_values(scores.data(), vc, table, acc.data(), rows, nk, kvh, hkv, d, block_size);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      T* dst = op + (t0 + i) * (hq * d) + (kvh * group + g) * d;
      const float* a = acc.data() + (i * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(a[x]);
    }
}

#if defined(__AVX512BF16__)
// softmax over n floats in place, 16 lanes at a time: max, e^(x - max), sum, scale
inline void softmax_row16(float* s, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  const __m512 mx = _mm512_set1_ps(max16(s, n));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, tail, s + full), mx));
    _mm512_mask_storeu_ps(s + full, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < full; j += 16)
    _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  if (tail)
    _mm512_mask_storeu_ps(s + full, tail,
                          _mm512_mul_ps(_mm512_mask_loadu_ps(ninf, tail, s + full), inv));
}

// V rows of kv head h for keys [0, nk) as fp32 [nk, D]
template <int D>
inline void values_f32(const at::BFloat16* vc, const int64_t* table, float* vf, int64_t nk,
                       int64_t h, int64_t hkv, int64_t block_size) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const at::BFloat16* row = vc + (slot * hkv + h) * D;
    for (int64_t x = 0; x < D; x += 16) _mm512_storeu_ps(vf + j * D + x, load16(row + x));
  }
}

// weighted_values_regs over fp32 V rows [nk, 16 CHUNKS] (values_f32), key by key with no
// block table, 6 rows at a time (24 accumulators): weighted_values_rows' 4-row blocks run on
// the same fp32 rows took 2.5 ms where this takes 2.0 (21-token tree query, 30 layers)
template <int ROWS, int CHUNKS>
inline void weighted_values_f32_regs(const float* p, const float* vf, float* acc, int64_t nk) {
  constexpr int64_t d = CHUNKS * 16;
  __m512 a[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = _mm512_loadu_ps(vf + j * d + c * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * nk + j]);
      for (int c = 0; c < CHUNKS; ++c) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + r * d + c * 16, a[r][c]);
}

// From this many rows per kv head a job converts the head's V rows to fp32 once and reads
// them from there (weighted_values_rows converts every V row again for each block of 4 rows:
// 16 times for a verify step's 63 rows). A row's arithmetic is the same either way: the same
// fp32 values, summed over the keys in order. 30 layers of a 21-token tree query over 150
// keys, 2 threads: 3.0 -> 2.0 ms (benchmarks/tree_attention.py).
constexpr int64_t VALUES_F32_MIN_ROWS = 8;

template <int CHUNKS>
void weighted_values_f32(const float* p, const float* vf, float* acc, int64_t rows,
                         int64_t nk) {
  constexpr int64_t d = CHUNKS * 16;
  constexpr int R = CHUNKS == 4 ? 6 : 3;  // 24 accumulators in registers
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R)
    weighted_values_f32_regs<R, CHUNKS>(p + r0 * nk, vf, acc + r0 * d, nk);
  for (; r0 < rows; ++r0) weighted_values_f32_regs<1, CHUNKS>(p + r0 * nk, vf, acc + r0 * d, nk);
}

// attend_one for bf16 caches and head dims 64/128, over kv heads [h0, h1), query tokens
// [i0, i1) and query heads [g0, g1) of each kv head's group, of one sequence at once (the
// heads' rows read ahead first where `touch`): each block's cache rows (every head of a slot
// is one contiguous row) are read in one sweep and the next block's keys and this block's values are
// prefetched, so a sequence's KV streams from memory instead of arriving head by head in
// scattered lines. Each query row's arithmetic is the same whichever others share its job.
template <int D>
void attend_heads_bf16(const at::BFloat16* qp, const at::BFloat16* kc,
                       const at::BFloat16* vc, at::BFloat16* op, const int64_t* table,
                       int64_t t0, int64_t i0, int64_t i1, int64_t ctx, int64_t h0, int64_t h1,
                       int64_t hkv, int64_t group, int64_t g0, int64_t g1, int64_t q_row,
                       int64_t q_head, int64_t block_size, float scale, const int64_t* tree,
                       bool touch,
                       std::vector<uint16_t>& qb, std::vector<float>& scores,
                       std::vector<float>& acc, std::vector<float>& vf) {
  // token i sees keys up to ctx + i: the job's last token bounds the keys it reads; gn rows
  // (query heads) per query token
  const int64_t nq = i1 - i0, nk = ctx + i1, gn = g1 - g0, rows = nq * gn, heads = h1 - h0;
  const int64_t stride = hkv * D;
  t0 += i0;
  qb.resize(heads * rows * D);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = g0; g < g1; ++g) {
        const auto* src = reinterpret_cast<const uint16_t*>(
            qp + (t0 + i) * q_row + (h * group + g) * q_head);
        std::copy(src, src + D, qb.data() + ((h - h0) * rows + i * gn + g - g0) * D);
      }
  scores.resize(heads * rows * nk);
  const __m512 sc = _mm512_set1_ps(scale);
  if (touch) touch_rows(kc + h0 * D, vc + h0 * D, table, nk, stride, heads * D, block_size);
  for (int64_t j0 = 0; j0 < nk;) {
    const int64_t n = std::min<int64_t>({16, block_size - j0 % block_size, nk - j0});
    const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
    for (int64_t h = h0; h < h1; ++h)
      score_keys<D>(qb.data() + (h - h0) * rows * D, rows, kc + slot * stride + h * D, stride,
                    n, scores.data() + (h - h0) * rows * nk + j0, nk, sc);
    j0 += n;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores.data() + h * rows * nk;
    mask_query_block(sh, tree, t0, nq, ctx, nk, gn, i0);
    for (int64_t r = 0; r < rows; ++r) softmax_row16(sh + r * nk, nk);
  }
  acc.resize(heads * rows * D);
  for (int64_t h = h0; h < h1; ++h) {
    const float* p = scores.data() + (h - h0) * rows * nk;
    float* a = acc.data() + (h - h0) * rows * D;
    if (rows >= VALUES_F32_MIN_ROWS) {
      vf.resize(nk * D);
      values_f32<D>(vc, table, vf.data(), nk, h, hkv, block_size);
      weighted_values_f32<D / 16>(p, vf.data(), a, rows, nk);
    } else {
      weighted_values_rows<D / 16>(p, vc, table, a, rows, nk, h, hkv, block_size);
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = g0; g < g1; ++g) {
        at::BFloat16* dst = op + (t0 + i) * (hkv * group * D) + (h * group + g) * D;
        const float* a = acc.data() + ((h - h0) * rows + i * gn + g - g0) * D;
        for (int64_t x = 0; x < D; x += 16)  // round to nearest even, as static_cast
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + x)));
      }
}
#endif

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& tree_mask) {
  const int64_t num_seqs = context_lens.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), group = hq / hkv;
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              out.is_contiguous(), "paged_attention: unexpected layout");
  auto bt = block_table.contiguous().to(at::kLong);
  auto qs = query_start.contiguous().to(at::kLong);
  auto ql = query_lens.contiguous().to(at::kLong);
  auto ctx = context_lens.contiguous().to(at::kLong);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t *qsp = qs.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>();
  const int64_t* cxp = ctx.data_ptr<int64_t>();
  const int64_t bt_width = bt.size(1);
  at::Tensor tm;
  if (tree_mask.has_value()) {
    tm = tree_mask->contiguous().to(at::kLong);
    TORCH_CHECK(tm.dim() == 1 && tm.size(0) >= q.size(0), "paged_attention: tree_mask must "
                "hold one entry per flat token");
  }
  const int64_t* tree = tree_mask.has_value() ? tm.data_ptr<int64_t>() : nullptr;
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && (d == 64 || d == 128)) {
    // a job per sequence (all its heads) when there are enough to share out, else per head;
    // and where too few per-head jobs would leave threads idle (a verify step at batch 1: 3
    // kv heads on 2 threads is one thread's 2 heads against the other's 1), per head and
    // slice of the sequence's query tokens, or for single-token queries (decode at batch 1:
    // 9 query heads on 2 threads, 6 against 3 by kv head) per head and slice of its group of
    // query heads (4 against 5). A row's arithmetic is the same in any job.
    const int64_t threads = at::get_num_threads();
    const int64_t per_job = num_seqs >= 2 * threads ? hkv : 1;
    const int64_t jobs_per_seq = hkv / per_job;
    int64_t max_q = 0;
    for (int64_t s = 0; s < num_seqs; ++s) max_q = std::max(max_q, qlp[s]);
    const bool idle = per_job == 1 && (num_seqs * hkv) % threads != 0;
    const int64_t token_slices = idle ? std::min(threads, max_q) : 1;
    const int64_t group_slices = idle && max_q == 1 ? std::min(threads, group) : 1;
    const int64_t slices = token_slices * group_slices;
    const auto f = d == 64 ? &attend_heads_bf16<64> : &attend_heads_bf16<128>;
    at::parallel_for(0, num_seqs * jobs_per_seq * slices, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> qb;
      std::vector<float> scores, acc, vf;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t slice = job % slices, head_job = job / slices;
        const int64_t s = head_job / jobs_per_seq, h0 = head_job % jobs_per_seq * per_job;
        // equal slices of the query tokens (token i reads ctx + i + 1 keys: about equal work)
        const int64_t ts = slice / group_slices, gs = slice % group_slices;
        const int64_t nq = qlp[s], i0 = nq * ts / token_slices, i1 = nq * (ts + 1) / token_slices;
        const int64_t g0 = group * gs / group_slices, g1 = group * (gs + 1) / group_slices;
        if (i0 == i1 || g0 == g1) continue;
        // a job's heads are read ahead once per thread (its later slices of them find them cached)
        const bool touch = job == begin || (job - 1) / slices != head_job;
        f(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
          v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), btp + s * bt_width,
          qsp[s], i0, i1, cxp[s], h0, h0 + per_job, hkv, group, g0, g1, q.stride(0),
          q.stride(1), block_size, static_cast<float>(scale), tree, touch, qb, scores, acc,
          vf);
      }
    });
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attn", [&] {
    at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, scores, acc;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t s = job / hkv;
        attend_one<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                             v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             btp + s * bt_width, qsp[s], qlp[s], cxp[s], job % hkv, hkv, group,
                             d, q.stride(0), q.stride(1), block_size,
                             static_cast<float>(scale), tree, qf, scores, acc);
      }
    });
  });
}

}  // namespace kiln
