// A mixture-of-experts layer's routed experts in one call: every routed (token, slot) pair
// through its expert's SwiGLU MLP, summed per token with the routing weights.
//
//   y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = experts[t, j]
//
// Weights: each expert's fused gate/up [2I, H] and down [H, I] projections VNNI-packed
// (gemm_vnni.cpp) and stacked by expert, [E, 2I/16, H/2, 16, 2] and [E, H/16, I/2, 16, 2], so
// the experts a step routes to are E-strided runs of one tensor and the rest are never read.
//
// One parallel region per call, in four phases split by barriers: (1) the gate/up panels of
// every active expert, (2) silu(gate) * up per row, (3) the down panels, (4) the weighted sum
// per token. The pairs are grouped by expert first (a counting sort, serial: T * k entries),
// so an expert's rows are one contiguous block and its weights are read once for all of
// them. Phases (1) and (3) parallelise over (active expert, panel of output blocks): at batch
// 1 each expert is one row, too small to split its GEMM over threads on its own, and the
// experts side by side are one stream of weights each thread reads front to back. Each
// thread takes a contiguous run of panels of about equal cost.
//
// Torch reference: the per-expert path of kiln.models.layers.moe.FusedExperts with kiln's
// VNNI linears and silu_mul. Every rounding is that path's: gate/up and down outputs rounded
// to bf16 from fp32 sums (the same register tiles, vnni_tile.h), silu * up computed as
// silu_mul computes it, the weighted sum in fp32, rounded once to bf16. Only the order of the
// k terms of the sum may differ from torch's bmm.
#include <omp.h>

#include "ops.h"
#include "vnni_tile.h"

namespace kiln {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {

// The routed pairs grouped by expert: rows [start[a], start[a + 1]) are active expert
// expert[a]'s, in token order; token t's rows (slot order) are
// token_rows[token_start[t] .. token_start[t + 1]).
struct ExpertRows {
  std::vector<int64_t> expert, start, row_token, token_start, token_rows;
  std::vector<float> row_weight;

  int64_t rows() const { return static_cast<int64_t>(row_token.size()); }
};

ExpertRows group_by_expert(const at::Tensor& experts, const at::Tensor& weights,
                           const bool* owned, int64_t num_experts) {
  const int64_t T = experts.size(0), k = experts.size(1);
  const int64_t* ids = experts.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (owned && !owned[i]) continue;
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_experts, "moe_experts_vnni: expert id ", ids[i],
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

// Every active expert's panels over `blocks` output blocks (4 blocks per panel below 8 rows,
// 3 from 8, as gemm_vnni.cpp's dispatch), and the running cost of the panels before each
// (prefix[i]): weight bytes read plus work per row.
void plan_panels(const ExpertRows& g, int64_t blocks, std::vector<Panel>& panels,
                 std::vector<int64_t>& prefix) {
  panels.clear();
  prefix.assign(1, 0);
  for (size_t a = 0; a < g.expert.size(); ++a) {
    const int64_t row = g.start[a], rows = g.start[a + 1] - row;
    const int nv = rows < 8 ? 4 : 3;
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

// y rows of one panel: x [rows, P] bf16 pairs, the expert's packed weight w, y [rows, N].
template <typename Out>
void run_panel(const Panel& p, const int32_t* x, int64_t P, const at::BFloat16* w,
               int64_t expert_elems, Out* y, int64_t N) {
  const int32_t* xr = x + p.row * P;
  const at::BFloat16* we = w + p.expert * expert_elems;
  Out* yr = y + p.row * N;
  switch (p.nv) {
    case 1: return vnni::vnni_panel<1, Out>(xr, p.rows, P, we, p.block, yr, N);
    case 2: return vnni::vnni_panel<2, Out>(xr, p.rows, P, we, p.block, yr, N);
    case 3: return vnni::vnni_panel<3, Out>(xr, p.rows, P, we, p.block, yr, N);
    default: return vnni::vnni_panel<4, Out>(xr, p.rows, P, we, p.block, yr, N);
  }
}

// act[:I] = silu(gate) * up for one row of gate/up [2I], as kiln::silu_mul computes it (the
// per-expert path's op).
void silu_mul_row(const at::BFloat16* gate_up, int64_t I, at::BFloat16* act) {
  float negated[256], e[256];
  for (int64_t i0 = 0; i0 < I; i0 += 256) {  // silu(g) = g / (1 + e^-g), in fp32
    const int64_t n = std::min<int64_t>(256, I - i0);
    for (int64_t i = 0; i < n; ++i) negated[i] = -f32(gate_up[i0 + i]);
    exp_shifted(negated, e, n, 0.f);
    for (int64_t i = 0; i < n; ++i)
      act[i0 + i] = static_cast<at::BFloat16>(-negated[i] / (1.f + e[i]) *
                                              f32(gate_up[I + i0 + i]));
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

// Scratch of one call, rows in expert order: x gathered, the gate/up outputs, silu(gate) * up,
// the down outputs. (Packed layers have H % 16 == 0 and 2I % 16 == 0: no odd pair to pad.)
struct Scratch {
  at::Tensor x, gate_up, act, down;
};

void run_experts(const ExpertRows& g, const at::Tensor& x, const at::Tensor& gate_up_w,
                 const at::Tensor& down_w, const Scratch& s, at::Tensor& y) {
  const int64_t T = x.size(0), H = x.size(1), R = g.rows();
  const int64_t B1 = gate_up_w.size(1), P1 = H / 2, I = B1 * vnni::kBlock / 2;
  const int64_t B2 = down_w.size(1), P2 = I / 2;
  std::vector<Panel> up_panels, down_panels;
  std::vector<int64_t> up_cost, down_cost;
  plan_panels(g, B1, up_panels, up_cost);
  plan_panels(g, B2, down_panels, down_cost);
  const auto* xs = x.data_ptr<at::BFloat16>();
  auto* xg = s.x.data_ptr<at::BFloat16>();
  auto* gu = s.gate_up.data_ptr<at::BFloat16>();
  auto* act = s.act.data_ptr<at::BFloat16>();
  auto* dn = s.down.data_ptr<at::BFloat16>();
  auto* out = y.data_ptr<at::BFloat16>();
  const auto* wu = gate_up_w.data_ptr<at::BFloat16>();
  const auto* wd = down_w.data_ptr<at::BFloat16>();
  const int64_t chunks = (H + kCombineChunk - 1) / kCombineChunk;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int id = omp_get_thread_num(), n = omp_get_num_threads();
    auto [r0, r1] = share(R, id, n);
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(xg + r * H, xs + g.row_token[r] * H, H * sizeof(at::BFloat16));
#pragma omp barrier
    auto [u0, u1] = share(up_cost, id, n);
    for (int64_t i = u0; i < u1; ++i)
      run_panel(up_panels[i], reinterpret_cast<const int32_t*>(xg), P1, wu, B1 * P1 * 32, gu,
                2 * I);
#pragma omp barrier
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gu + r * 2 * I, I, act + r * I);
#pragma omp barrier
    auto [d0, d1] = share(down_cost, id, n);
    for (int64_t i = d0; i < d1; ++i)
      run_panel(down_panels[i], reinterpret_cast<const int32_t*>(act), P2, wd, B2 * P2 * 32,
                dn, H);
#pragma omp barrier
    auto [c0, c1] = share(T * chunks, id, n);
    for (int64_t c = c0; c < c1; ++c)
      combine_chunk(g, dn, H, c / chunks, (c % chunks) * kCombineChunk, out);
  }
}

}  // namespace
#endif

at::Tensor moe_experts_vnni(const at::Tensor& x, const at::Tensor& experts,
                            const at::Tensor& weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& owned) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "moe_experts_vnni: x must be bfloat16 [T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == T && experts.scalar_type() == at::kLong,
              "moe_experts_vnni: experts must be int64 [T, k] with T = ", T);
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat,
              "moe_experts_vnni: weights must be float32 ", experts.sizes());
  TORCH_CHECK(!owned || (owned->sizes() == experts.sizes() &&
                         owned->scalar_type() == at::kBool),
              "moe_experts_vnni: owned must be bool ", experts.sizes());
  TORCH_CHECK(gate_up.dim() == 5 && gate_up.size(3) == 16 && gate_up.size(4) == 2 &&
                  gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(),
              "moe_experts_vnni: gate_up must be VNNI-packed bfloat16 [E, 2I/16, H/2, 16, 2]");
  TORCH_CHECK(down.dim() == 5 && down.size(3) == 16 && down.size(4) == 2 &&
                  down.scalar_type() == at::kBFloat16 && down.is_contiguous(),
              "moe_experts_vnni: down must be VNNI-packed bfloat16 [E, H/16, I/2, 16, 2]");
  const int64_t E = gate_up.size(0), I = gate_up.size(1) * 8;
  TORCH_CHECK(down.size(0) == E, "moe_experts_vnni: ", E, " gate_up experts, ", down.size(0),
              " down");
  TORCH_CHECK(gate_up.size(2) * 2 == H, "moe_experts_vnni: x has ", H,
              " features, gate_up packs ", 2 * gate_up.size(2));
  TORCH_CHECK(down.size(1) * 16 == H && down.size(2) * 2 == I, "moe_experts_vnni: down ",
              down.sizes(), " does not map ", I, " features to ", H);
  auto y = at::empty({T, H}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  auto xc = x.contiguous();
  auto ids = experts.contiguous();
  auto w = weights.contiguous();
  at::Tensor mask = owned ? owned->contiguous() : at::Tensor();
  const ExpertRows g = group_by_expert(ids, w, owned ? mask.data_ptr<bool>() : nullptr, E);
  const int64_t R = g.rows();
  if (R == 0) return y.zero_();
  const auto opts = x.options();
  Scratch s{at::empty({R, H}, opts), at::empty({R, 2 * I}, opts), at::empty({R, I}, opts),
            at::empty({R, H}, opts)};
  run_experts(g, xc, gate_up, down, s, y);
  return y;
#else
  TORCH_CHECK(false, "moe_experts_vnni: this build has no AVX512-BF16 (check "
                     "bf16_vnni_available)");
  return y;
#endif
}

}  // namespace kiln
