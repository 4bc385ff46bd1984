// A mixture-of-experts layer's routed experts in one call: every routed (token, slot) pair
// through its expert's SwiGLU MLP, summed per token with the routing weights.
//
//   y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = experts[t, j]
//
// Weights: each expert's fused gate/up [2I, H] and down [H, I] projections in a dense linear
// format kiln has a decode kernel for, stacked by expert so the experts a step routes to are
// E-strided runs of one tensor and the rest are never read:
//   - bf16, VNNI-packed (gemm_vnni.cpp): [E, 2I/16, H/2, 16, 2] and [E, H/16, I/2, 16, 2];
//   - int8 weight-only, int8-VNNI-packed (gemm_int8_vnni.cpp): uint8 w + 128
//     [E, 2I/16, H/4, 16, 4] and [E, H/16, I/4, 16, 4], with one fp32 scale per output row,
//     [E, 2I] and [E, H]; the rows' activations become three base-256 digits each (phases 0
//     and 2) and every projection is integer dot products (int8_vnni_tile.h);
//   - int8 weight-only rows (gemm.cpp's int8_gemv; CPUs without AVX512-VNNI, or
//     KILN_INT8_VNNI=0): [E, 2I, H] and [E, H, I], with their per-row scales.
//
// One parallel region per call, in phases split by barriers: (0) x gathered into expert
// order, (1) the gate/up panels of every active expert, (2) silu(gate) * up per row, (3) the
// down panels, (4) the weighted sum per token. The pairs are grouped by expert first (a
// counting sort, serial: T * k entries), so an expert's rows are one contiguous block and its
// weights are read once for all of them. Phases (1) and (3) parallelise over (active expert,
// panel of 16-row output blocks): at batch 1 each expert is one row, too small to split its
// GEMV over threads on its own, and the experts side by side are one stream of weights each
// thread reads front to back. Each thread takes a contiguous run of panels of about equal
// cost (docs/decisions/0015).
//
// Torch reference: the per-expert path of kiln.models.layers.experts.FusedExperts (each expert's
// own linears, kiln's silu_mul, torch's weighted sum). Every rounding is that path's:
// gate/up and down outputs rounded to bf16 from the sums of the same register tiles
// (vnni_tile.h, int8_vnni_tile.h, int8_rows.h), silu * up computed as silu_mul computes it,
// the weighted sum in fp32, rounded once to bf16. Only the order of the k terms of that sum
// may differ from torch's bmm.
#include <omp.h>

#include "int8_rows.h"
#include "int8_vnni_tile.h"
#include "ops.h"
#include "vnni_tile.h"

namespace kiln {
namespace {

constexpr int64_t kBlock = 16;  // output rows per block: a packed VNNI block, a unit of panels

// The routed pairs grouped by expert: rows [start[a], start[a + 1]) are active expert
// expert[a]'s, in token order; token t's rows (slot order) are
// token_rows[token_start[t] .. token_start[t + 1]).
struct ExpertRows {
  std::vector<int64_t> expert, start, row_token, token_start, token_rows;
  std::vector<float> row_weight;

  int64_t rows() const { return static_cast<int64_t>(row_token.size()); }
};

ExpertRows group_by_expert(const at::Tensor& experts, const at::Tensor& weights,
                           const bool* owned, int64_t num_experts, const char* op) {
  const int64_t T = experts.size(0), k = experts.size(1);
  const int64_t* ids = experts.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (owned && !owned[i]) continue;
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_experts, op, ": expert id ", ids[i],
                " of token ", i / k, " is outside the ", num_experts, " stacked experts");
    ++count[ids[i] + 1];
  }
  ExpertRows g;
  std::vector<int64_t> next(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    next[e] = count[e];  // (prefix sum so far) the first row of expert e
    count[e + 1] += count[e];
    if (count[e + 1] > count[e]) g.expert.push_back(e), g.start.push_back(count[e]);
  }
  g.start.push_back(count[num_experts]);
  g.row_token.resize(count[num_experts]);
  g.row_weight.resize(count[num_experts]);
  g.token_start.assign(1, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (owned && !owned[i]) continue;
      const int64_t row = next[ids[i]]++;
      g.row_token[row] = t, g.row_weight[row] = w[i];
      g.token_rows.push_back(row);
    }
    g.token_start.push_back(static_cast<int64_t>(g.token_rows.size()));
  }
  return g;
}

// One panel of one expert's projection: `nv` blocks from `block` over its `rows` rows.
struct Panel {
  int64_t expert, row, rows, block;
  int nv;
};

// The blocks of `next` (the thread's next panel) that follow `p`'s own in the same expert's
// weights, 0 if it is another expert's or there is none: what p's tiles fetch ahead into L2, as
// the dense GEMMs' panels do (decision 0023). 16 experts of 576 x 768, top 2, 8 layers, 2
// threads on Zen 4, alternated in one process, medians of 6: int8 at 48 tokens 11.01 -> 10.66
// ms (every pair ahead); bf16 at 48 tokens 11.71 -> 11.64 (most experts then have fewer than 8
// rows, which fetch nothing)
inline int64_t blocks_after(const Panel& p, const Panel* next) {
  return next != nullptr && next->expert == p.expert && next->block == p.block + p.nv
      ? next->nv : 0;
}

// Every active expert's panels over a projection's N / 16 output blocks, and the running cost
// of the panels before each (prefix[i]): weight bytes read plus work per row.
template <typename Proj>
void plan_panels(const ExpertRows& g, const Proj& proj, std::vector<Panel>& panels,
                 std::vector<int64_t>& prefix) {
  const int64_t blocks = proj.N / kBlock;
  panels.clear();
  prefix.assign(1, 0);
  for (size_t a = 0; a < g.expert.size(); ++a) {
    const int64_t row = g.start[a], rows = g.start[a + 1] - row;
    const int nv = proj.panel_blocks(rows);
    for (int64_t b = 0; b < blocks; b += nv) {
      const int width = static_cast<int>(std::min<int64_t>(nv, blocks - b));
      panels.push_back({g.expert[a], row, rows, b, width});
      prefix.push_back(prefix.back() + width * (2 + rows));
    }
  }
}

// [begin, end) of the items thread `id` of `n` runs, from the items' running cost `prefix`
// (strictly increasing): contiguous runs of about equal cost.
std::pair<int64_t, int64_t> share(const std::vector<int64_t>& prefix, int id, int n) {
  const int64_t total = prefix.back();
  auto at = [&](int i) {
    return static_cast<int64_t>(
        std::lower_bound(prefix.begin(), prefix.end(), total * i / n) - prefix.begin());
  };
  return {at(id), at(id + 1)};
}

std::pair<int64_t, int64_t> share(int64_t items, int id, int n) {
  return {items * id / n, items * (id + 1) / n};
}

template <typename In>
void gather_row(const at::BFloat16* src, int64_t n, In* dst) {
  if constexpr (std::is_same_v<In, at::BFloat16>) {
    std::memcpy(dst, src, n * sizeof(at::BFloat16));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32(src[i]);
  }
}

// The grouped rows' activations [R, K] as a projection reads them: written row by row through
// `row(r)` (x gathered, or silu * up), then `done(r)` by the same thread. Plain: the rows
// themselves, in bf16 or widened to fp32.
template <typename T>
struct PlainRows {
  at::Tensor data;
  int64_t K;

  PlainRows(const ExpertRows& g, int64_t K, const at::TensorOptions& opts)
      : data(at::empty({g.rows(), K}, opts.dtype(std::is_same_v<T, float> ? at::kFloat
                                                                           : at::kBFloat16))),
        K(K) {}
  T* row(int64_t r) { return static_cast<T*>(data.data_ptr()) + r * K; }
  const T* rows() const { return static_cast<const T*>(data.data_ptr()); }
  void done(int64_t) {}
};

#if KILN_INT8_VNNI
// The rows as int8_vnni digits (int8_vnni_tile.h): each active expert's run of rows is one
// matmul's tokens, in tiles of 8 from the run's first row, so its digits lie as
// int8_vnni_mm's for those rows alone (row r's quads from 3 P r on); per row the scale and
// offset correction. Rows are staged in bf16 and split by `done`.
struct DigitRows {
  at::Tensor staged;
  std::vector<int32_t> quads;
  std::vector<double> scale;
  std::vector<int64_t> offset;
  std::vector<int8_vnni::TokenSlot> slot;
  int64_t K, P;

  DigitRows(const ExpertRows& g, int64_t K, const at::TensorOptions& opts)
      : staged(at::empty({g.rows(), K}, opts.dtype(at::kBFloat16))),
        quads(g.rows() * 3 * ((K + 3) / 4)), scale(g.rows()), offset(g.rows()),
        slot(g.rows()), K(K), P((K + 3) / 4) {
    for (size_t a = 0; a < g.expert.size(); ++a) {
      const int64_t first = g.start[a], count = g.start[a + 1] - first;
      for (int64_t m = 0; m < count; ++m) {
        const int8_vnni::TokenSlot where = int8_vnni::token_slot(m, count, P);
        slot[first + m] = {3 * P * first + where.base, where.stride};
      }
    }
  }
  at::BFloat16* row(int64_t r) { return staged.data_ptr<at::BFloat16>() + r * K; }
  void done(int64_t r) {
    int8_vnni::token_digits(row(r), K, P, quads.data() + slot[r].base, slot[r].stride,
                            scale[r], offset[r]);
  }
};

// int8 experts, int8-VNNI-packed and stacked: uint8 [E, N/16, K/4, 16, 4], scales [E, N].
// An expert's rows run as int8_vnni_mm runs them (int8_vnni::panel), panels of 4 blocks.
struct Int8VnniProjection {
  using Rows = DigitRows;
  const uint8_t* w;
  const float* scale;
  int64_t N, K;

  int panel_blocks(int64_t) const { return 4; }

  void run(const Panel& p, const Rows& x, at::BFloat16* y, const Panel* next) const {
    const int64_t P = x.P, n0 = p.block * kBlock;
    int8_vnni::panel<at::BFloat16>(
        x.quads.data() + 3 * P * p.row, x.offset.data() + p.row, x.scale.data() + p.row,
        p.rows, P, w + (p.expert * (N / kBlock) + p.block) * P * 64, p.nv,
        scale + p.expert * N + n0, y + p.row * N + n0, N, N - n0,
        blocks_after(p, next));
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 experts, VNNI-packed and stacked: [E, N/16, K/2, 16, 2]. Rows read as bf16 pairs.
struct VnniProjection {
  using Rows = PlainRows<at::BFloat16>;
  const at::BFloat16* w;
  int64_t N, K;

  // gemm_vnni.cpp's dispatch: one block per panel for one row (a thread's run of blocks, end
  // to end, streams in sequence), 4 below 8 rows, 3 from 8
  int panel_blocks(int64_t rows) const { return rows == 1 ? 1 : (rows < 8 ? 4 : 3); }

  void run(const Panel& p, const Rows& x, at::BFloat16* y, const Panel* next) const {
    const auto* xr = reinterpret_cast<const int32_t*>(x.rows() + p.row * K);
    const at::BFloat16* we = w + p.expert * N * K;
    at::BFloat16* yr = y + p.row * N;
    const int64_t P = K / 2;
    switch (p.nv) {
      case 1: return vnni::vnni_panel<1>(xr, p.rows, P, we, p.block, yr, N);
      case 2: return vnni::vnni_panel<2>(xr, p.rows, P, we, p.block, yr, N);
      case 3: return vnni::vnni_panel<3>(xr, p.rows, P, we, p.block, yr, N, blocks_after(p, next));
      default: return vnni::vnni_panel<4>(xr, p.rows, P, we, p.block, yr, N);
    }
  }
};
#endif

// y[m, n0:n1] for M rows of fp32 x, R weight rows at a time (as gemm.cpp's int8_gemv).
template <int M, int R>
void int8_rows(const float* x, int64_t K, const int8_t* w, const float* scale, int64_t n0,
               int64_t n1, at::BFloat16* y, int64_t N) {
  float acc[R * M];
  for (int64_t n = n0; n < n1; n += R) {
    int8_dot_rows<M, R>(x, w + n * K, K, acc);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = static_cast<at::BFloat16>(scale[n + r] * acc[r * M + m]);
  }
}

// int8 weight-only experts (kiln's int8 format) stacked: rows [E, N, K], scales [E, N]. Rows
// read as fp32 (the bf16 values widened), in tiles of up to 8 with int8_gemv's R per tile.
struct Int8Projection {
  using Rows = PlainRows<float>;
  const int8_t* w;
  const float* scale;
  int64_t N, K;

  int panel_blocks(int64_t) const { return 4; }

  void run(const Panel& p, const Rows& rows, at::BFloat16* y, const Panel*) const {
    const float* x = rows.rows();
    const int8_t* we = w + p.expert * N * K;
    const float* se = scale + p.expert * N;
    const int64_t n0 = p.block * kBlock, n1 = std::min(N, n0 + p.nv * kBlock);
    for (int64_t m0 = 0; m0 < p.rows; m0 += 8) {
      const float* xr = x + (p.row + m0) * K;
      at::BFloat16* yr = y + (p.row + m0) * N;
      switch (std::min<int64_t>(8, p.rows - m0)) {
        case 1: int8_rows<1, 8>(xr, K, we, se, n0, n1, yr, N); break;
        case 2: int8_rows<2, 4>(xr, K, we, se, n0, n1, yr, N); break;
        case 3: int8_rows<3, 2>(xr, K, we, se, n0, n1, yr, N); break;
        case 4: int8_rows<4, 2>(xr, K, we, se, n0, n1, yr, N); break;
        case 5: int8_rows<5, 2>(xr, K, we, se, n0, n1, yr, N); break;
        case 6: int8_rows<6, 2>(xr, K, we, se, n0, n1, yr, N); break;
        case 7: int8_rows<7, 2>(xr, K, we, se, n0, n1, yr, N); break;
        default: int8_rows<8, 2>(xr, K, we, se, n0, n1, yr, N); break;
      }
    }
  }
};

// act[:I] = silu(gate) * up for one row of gate/up [2I], as kiln::silu_mul computes it (the
// per-expert path's op), rounded to bf16 (then widened where the down projection reads fp32).
template <typename In>
void silu_mul_row(const at::BFloat16* gate_up, int64_t I, In* act) {
  if constexpr (std::is_same_v<In, at::BFloat16>) {
    silu_mul_bf16(gate_up, gate_up + I, I, act);
  } else {
    at::BFloat16 rounded[256];
    for (int64_t i0 = 0; i0 < I; i0 += 256) {
      const int64_t n = std::min<int64_t>(256, I - i0);
      silu_mul_bf16(gate_up + i0, gate_up + I + i0, n, rounded);
      for (int64_t i = 0; i < n; ++i) act[i0 + i] = static_cast<In>(rounded[i]);
    }
  }
}

constexpr int64_t kCombineChunk = 256;  // outputs of one token per combine item

// y[t, h0:h0+n] = sum over t's rows (slot order) of weight * down row, in fp32.
void combine_chunk(const ExpertRows& g, const at::BFloat16* down, int64_t H, int64_t t,
                   int64_t h0, at::BFloat16* y) {
  const int64_t n = std::min(kCombineChunk, H - h0);
  float acc[kCombineChunk] = {};
  for (int64_t i = g.token_start[t]; i < g.token_start[t + 1]; ++i) {
    const int64_t row = g.token_rows[i];
    const float w = g.row_weight[row];
    const at::BFloat16* d = down + row * H + h0;
    for (int64_t h = 0; h < n; ++h) acc[h] += w * f32(d[h]);
  }
  for (int64_t h = 0; h < n; ++h) y[t * H + h0 + h] = static_cast<at::BFloat16>(acc[h]);
}

// The four phases over the grouped rows (the header's plan): x [T, H] bf16 -> y [T, H] bf16.
template <typename Proj>
at::Tensor run_experts(const ExpertRows& g, const at::Tensor& x, const Proj& up,
                       const Proj& down) {
  const int64_t T = x.size(0), H = x.size(1), R = g.rows(), I = up.N / 2;
  auto y = at::empty({T, H}, x.options());
  if (R == 0) return y.zero_();
  typename Proj::Rows xg(g, H, x.options()), act(g, I, x.options());
  at::Tensor gu_t = at::empty({R, 2 * I}, x.options()), dn_t = at::empty({R, H}, x.options());
  std::vector<Panel> up_panels, down_panels;
  std::vector<int64_t> up_cost, down_cost;
  plan_panels(g, up, up_panels, up_cost);
  plan_panels(g, down, down_panels, down_cost);
  const auto* xs = x.data_ptr<at::BFloat16>();
  auto* gu = gu_t.data_ptr<at::BFloat16>();
  auto* dn = dn_t.data_ptr<at::BFloat16>();
  auto* out = y.data_ptr<at::BFloat16>();
  const int64_t chunks = (H + kCombineChunk - 1) / kCombineChunk;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int id = omp_get_thread_num(), n = omp_get_num_threads();
    auto [r0, r1] = share(R, id, n);
    for (int64_t r = r0; r < r1; ++r) {
      gather_row(xs + g.row_token[r] * H, H, xg.row(r));
      xg.done(r);
    }
#pragma omp barrier
    auto [u0, u1] = share(up_cost, id, n);
    for (int64_t i = u0; i < u1; ++i)
      up.run(up_panels[i], xg, gu, i + 1 < u1 ? &up_panels[i + 1] : nullptr);
#pragma omp barrier
    for (int64_t r = r0; r < r1; ++r) {
      silu_mul_row(gu + r * 2 * I, I, act.row(r));
      act.done(r);
    }
#pragma omp barrier
    auto [d0, d1] = share(down_cost, id, n);
    for (int64_t i = d0; i < d1; ++i)
      down.run(down_panels[i], act, dn, i + 1 < d1 ? &down_panels[i + 1] : nullptr);
#pragma omp barrier
    auto [c0, c1] = share(T * chunks, id, n);
    for (int64_t c = c0; c < c1; ++c)
      combine_chunk(g, dn, H, c / chunks, (c % chunks) * kCombineChunk, out);
  }
  return y;
}

// The checks both entry points share; returns the grouped rows.
ExpertRows check_and_group(const char* op, const at::Tensor& x, const at::Tensor& experts,
                           const at::Tensor& weights, const std::optional<at::Tensor>& owned,
                           int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be contiguous bfloat16 [T, H]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) &&
                  experts.scalar_type() == at::kLong,
              op, ": experts must be int64 [T, k] with T = ", x.size(0));
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat, op,
              ": weights must be float32 ", experts.sizes());
  TORCH_CHECK(!owned || (owned->sizes() == experts.sizes() &&
                         owned->scalar_type() == at::kBool),
              op, ": owned must be bool ", experts.sizes());
  at::Tensor mask = owned ? owned->contiguous() : at::Tensor();
  return group_by_expert(experts.contiguous(), weights.contiguous(),
                         owned ? mask.data_ptr<bool>() : nullptr, num_experts, op);
}

}  // namespace

at::Tensor moe_experts_vnni(const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& owned) {
  const char* op = "moe_experts_vnni";
  TORCH_CHECK(gate_up.dim() == 5 && gate_up.size(3) == 16 && gate_up.size(4) == 2 &&
                  gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(),
              op, ": gate_up must be VNNI-packed bfloat16 [E, 2I/16, H/2, 16, 2]");
  TORCH_CHECK(down.dim() == 5 && down.size(3) == 16 && down.size(4) == 2 &&
                  down.scalar_type() == at::kBFloat16 && down.is_contiguous(),
              op, ": down must be VNNI-packed bfloat16 [E, H/16, I/2, 16, 2]");
  const int64_t E = gate_up.size(0), I = gate_up.size(1) * 8, H = x.size(-1);
  TORCH_CHECK(down.size(0) == E, op, ": ", E, " gate_up experts, ", down.size(0), " down");
  TORCH_CHECK(gate_up.size(2) * 2 == H, op, ": x has ", H, " features, gate_up packs ",
              2 * gate_up.size(2));
  TORCH_CHECK(down.size(1) * 16 == H && down.size(2) * 2 == I, op, ": down ", down.sizes(),
              " does not map ", I, " features to ", H);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const ExpertRows g = check_and_group(op, x, experts, weights, owned, E);
  return run_experts(g, x, VnniProjection{gate_up.data_ptr<at::BFloat16>(), 2 * I, H},
                     VnniProjection{down.data_ptr<at::BFloat16>(), H, I});
#else
  TORCH_CHECK(false, op, ": this build has no AVX512-BF16 (check bf16_vnni_available)");
  return x;
#endif
}

at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& weights, const at::Tensor& gate_up,
                            const at::Tensor& gate_up_scale, const at::Tensor& down,
                            const at::Tensor& down_scale, const std::optional<at::Tensor>& owned) {
  const char* op = "moe_experts_int8";
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.scalar_type() == at::kChar &&
                  gate_up.is_contiguous() && down.dim() == 3 &&
                  down.scalar_type() == at::kChar && down.is_contiguous(),
              op, ": gate_up [E, 2I, H] and down [E, H, I] must be contiguous int8");
  const int64_t E = gate_up.size(0), two_i = gate_up.size(1), H = x.size(-1);
  TORCH_CHECK(two_i % 16 == 0 && H % 16 == 0, op, ": 2I = ", two_i, " and H = ", H,
              " must be multiples of 16");
  TORCH_CHECK(gate_up.size(2) == H, op, ": x has ", H, " features, gate_up ", gate_up.size(2));
  TORCH_CHECK(down.sizes() == at::IntArrayRef({E, H, two_i / 2}), op, ": down ", down.sizes(),
              " does not map ", two_i / 2, " features to ", H, " for ", E, " experts");
  TORCH_CHECK(gate_up_scale.numel() == E * two_i && down_scale.numel() == E * H &&
                  gate_up_scale.scalar_type() == at::kFloat &&
                  down_scale.scalar_type() == at::kFloat && gate_up_scale.is_contiguous() &&
                  down_scale.is_contiguous(),
              op, ": one contiguous float32 scale per output row expected");
  const ExpertRows g = check_and_group(op, x, experts, weights, owned, E);
  return run_experts(
      g, x, Int8Projection{gate_up.data_ptr<int8_t>(), gate_up_scale.data_ptr<float>(), two_i, H},
      Int8Projection{down.data_ptr<int8_t>(), down_scale.data_ptr<float>(), H, two_i / 2});
}

at::Tensor moe_experts_int8_vnni(const at::Tensor& x, const at::Tensor& experts,
                                 const at::Tensor& weights, const at::Tensor& gate_up,
                                 const at::Tensor& gate_up_scale, const at::Tensor& down,
                                 const at::Tensor& down_scale,
                                 const std::optional<at::Tensor>& owned) {
  const char* op = "moe_experts_int8_vnni";
  TORCH_CHECK(gate_up.dim() == 5 && gate_up.size(3) == 16 && gate_up.size(4) == 4 &&
                  gate_up.scalar_type() == at::kByte && gate_up.is_contiguous(),
              op, ": gate_up must be int8-VNNI-packed uint8 [E, 2I/16, H/4, 16, 4]");
  TORCH_CHECK(down.dim() == 5 && down.size(3) == 16 && down.size(4) == 4 &&
                  down.scalar_type() == at::kByte && down.is_contiguous(),
              op, ": down must be int8-VNNI-packed uint8 [E, H/16, I/4, 16, 4]");
  const int64_t E = gate_up.size(0), two_i = gate_up.size(1) * 16, H = x.size(-1);
  TORCH_CHECK(down.size(0) == E, op, ": ", E, " gate_up experts, ", down.size(0), " down");
  TORCH_CHECK(gate_up.size(2) == (H + 3) / 4, op, ": x has ", H, " features, gate_up packs ",
              4 * gate_up.size(2));
  TORCH_CHECK(down.size(1) * 16 == H && down.size(2) == (two_i / 2 + 3) / 4, op, ": down ",
              down.sizes(), " does not map ", two_i / 2, " features to ", H);
  TORCH_CHECK(4 * std::max(gate_up.size(2), down.size(2)) <= 65536, op,
              ": more than 65536 input features (the int32 sums 255 * 128 * K would overflow)");
  TORCH_CHECK(gate_up_scale.numel() == E * two_i && down_scale.numel() == E * H &&
                  gate_up_scale.scalar_type() == at::kFloat &&
                  down_scale.scalar_type() == at::kFloat && gate_up_scale.is_contiguous() &&
                  down_scale.is_contiguous(),
              op, ": one contiguous float32 scale per output row expected");
#if KILN_INT8_VNNI
  const ExpertRows g = check_and_group(op, x, experts, weights, owned, E);
  return run_experts(g, x,
                     Int8VnniProjection{gate_up.data_ptr<uint8_t>(),
                                        gate_up_scale.data_ptr<float>(), two_i, H},
                     Int8VnniProjection{down.data_ptr<uint8_t>(), down_scale.data_ptr<float>(),
                                        H, two_i / 2});
#else
  TORCH_CHECK(false, op, ": this build has no AVX512-VNNI (check int8_vnni_available)");
  return x;
#endif
}

}  // namespace kiln
