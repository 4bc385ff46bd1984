// Fused elementwise ops of a decoder layer: RMS norm (with the residual add), SiLU-and-mul,
// in-place rotary embedding, and Qwen3's per-head q/k RMS norm fused with the rotation.
// Torch reference: kiln/models/layers/ops.py, rotary.py.

#include "ops.h"

namespace kiln {

namespace {

// out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)); optionally residual += x first.
template <typename T>
void rms_rows(T* out, T* x, T* residual, const T* w, int64_t rows, int64_t dim,
              int64_t x_stride, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          T sum = static_cast<T>(f32(rr[i]) + f32(xr[i]));  // the residual add rounds to T
          rr[i] = sum;
          buf[i] = f32(sum);
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) buf[i] = f32(xr[i]);
      }
      for (int64_t i = 0; i < dim; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        T normed = static_cast<T>(buf[i] * inv);
        o[i] = static_cast<T>(f32(w[i]) * f32(normed));
      }
    }
  });
}

}  // namespace

// rms_norm into `out` (contiguous, x's shape and dtype): the fused stack's one buffer per call.
void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), nullptr,
                       weight.data_ptr<scalar_t>(), rows, dim, dim, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_into(out, x, weight, eps);
  return out;
}

// residual += x (in place); out = rms_norm(residual).
void add_rms_norm_into(at::Tensor& out, const at::Tensor& x, at::Tensor& residual,
                       const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  auto xc = x.contiguous();
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms", [&] {
    rms_rows<scalar_t>(out.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                       residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, dim,
                       dim, eps);
  });
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  auto out = at::empty_like(residual);
  add_rms_norm_into(out, x, residual, weight, eps);
  return out;
}

// out[t, :I] = silu(x[t, :I]) * x[t, I:]
at::Tensor silu_mul(const at::Tensor& x) {
  auto xc = x.contiguous();
  const int64_t two_i = xc.size(-1), inner = two_i / 2, rows = xc.numel() / two_i;
  auto sizes = xc.sizes().vec();
  sizes.back() = inner;
  auto out = at::empty(sizes, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // 16 lanes at a time
        // (the casts only name the type this branch runs with: the lambda is no template)
        const auto* bin = reinterpret_cast<const at::BFloat16*>(in);
        auto* bout = reinterpret_cast<at::BFloat16*>(o);
        for (int64_t r = begin; r < end; ++r)
          silu_mul_bf16(bin + r * two_i, bin + r * two_i + inner, inner, bout + r * inner);
        return;
      }
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * two_i;
        const scalar_t* u = g + inner;
        scalar_t* orow = o + r * inner;
        float gate[256], negated[256];
        for (int64_t i0 = 0; i0 < inner; i0 += 256) {  // silu(g) = g / (1 + e^-g), in fp32
          const int64_t n = std::min<int64_t>(256, inner - i0);
          for (int64_t i = 0; i < n; ++i) negated[i] = -f32(g[i0 + i]);
          exp_shifted(negated, gate, n, 0.f);
          for (int64_t i = 0; i < n; ++i)
            orow[i0 + i] = static_cast<scalar_t>(-negated[i] / (1.f + gate[i]) * f32(u[i0 + i]));
        }
      }
    });
  });
  return out;
}

// In place on qkv [T, (Hq + 2 Hkv) * D]: rotate the q and k heads (rotate-half layout).
// cos/sin: [max_pos, D] fp32 tables (both halves duplicated, as HF builds them).
void rotary_inplace(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                    int64_t head_dim) {
  TORCH_CHECK(qkv.stride(-1) == 1, "qkv rows must be contiguous");
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t heads = num_q_heads + num_kv_heads;
  auto pos = positions.contiguous().to(at::kLong);
  auto c = cos.contiguous().to(at::kFloat);
  auto s = sin.contiguous().to(at::kFloat);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / heads, h = job % heads;
        scalar_t* v = base + t * row_stride + h * head_dim;
        const float* cr = cp + p[t] * head_dim;
        const float* sr = sp + p[t] * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]);
          v[i] = static_cast<scalar_t>(x1 * cr[i] - x2 * sr[i]);
          v[i + half] = static_cast<scalar_t>(x2 * cr[i + half] + x1 * sr[i + half]);
        }
      }
    });
  });
}

// In place on qkv [T, (Hq + 2 Hkv) * D]: each q and k head RMS-normed as rms_norm does it
// (fp32 sum of squares, w * bf16(x * rsqrt(mean + eps)), rounded to T), then rotated from
// those rounded values as rotary_inplace does (fp32 tables, one rounding): the two kernels
// one after the other, in one pass over the head. v is untouched.
void qk_norm_rotary_inplace(at::Tensor& qkv, const at::Tensor& positions,
                            const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                            int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.stride(-1) == 1, "qkv rows must be contiguous");
  TORCH_CHECK(q_weight.numel() == head_dim && k_weight.numel() == head_dim,
              "qk_norm_rotary_inplace: norm weights must have head_dim elements");
  TORCH_CHECK(cos.size(-1) == head_dim, "qk_norm_rotary_inplace: tables must span whole heads");
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t heads = num_q_heads + num_kv_heads;
  auto pos = positions.contiguous().to(at::kLong);
  auto c = cos.contiguous().to(at::kFloat);
  auto s = sin.contiguous().to(at::kFloat);
  auto qw = q_weight.contiguous().to(qkv.scalar_type());
  auto kw = k_weight.contiguous().to(qkv.scalar_type());
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qk_norm", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* qwp = qw.data_ptr<scalar_t>();
    const scalar_t* kwp = kw.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> normed(head_dim);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / heads, h = job % heads;
        scalar_t* v = base + t * row_stride + h * head_dim;
        const scalar_t* w = h < num_q_heads ? qwp : kwp;
        float ss = 0.f;
        for (int64_t i = 0; i < head_dim; ++i) ss += f32(v[i]) * f32(v[i]);
        const float inv =
            1.f / std::sqrt(ss / static_cast<float>(head_dim) + static_cast<float>(eps));
        for (int64_t i = 0; i < head_dim; ++i) {
          const scalar_t x = static_cast<scalar_t>(f32(v[i]) * inv);
          normed[i] = f32(static_cast<scalar_t>(f32(w[i]) * f32(x)));
        }
        const float* cr = cp + p[t] * head_dim;
        const float* sr = sp + p[t] * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = normed[i], x2 = normed[i + half];
          v[i] = static_cast<scalar_t>(x1 * cr[i] - x2 * sr[i]);
          v[i + half] = static_cast<scalar_t>(x2 * cr[i + half] + x1 * sr[i + half]);
        }
      }
    });
  });
}

}  // namespace kiln
