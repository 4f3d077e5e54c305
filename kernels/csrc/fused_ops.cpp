// Fused element-wise CPU ops of a decoder layer: RMSNorm (optionally after the residual add),
// SiLU- and tanh-GELU-and-multiply, and rotary embedding. Each computes in fp32 and rounds once to the
// tensor's dtype, as the PyTorch reference in runtime/models does; rows run on intra-op threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec_math.h"

namespace {

template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, T* sum_out, T* out, int64_t rows, int64_t dim,
                       float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> s(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      float ss = 0.0f;
      if (residual != nullptr) {
        const T* rr = residual + r * dim;
        T* so = sum_out + r * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const T v = static_cast<T>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));  // the dtype's sum
          so[d] = v;
          s[d] = static_cast<float>(v);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) s[d] = static_cast<float>(xr[d]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) ss += s[d] * s[d];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T normed = static_cast<T>(s[d] * inv);  // rounded to the dtype before the weight, like HF
        o[d] = static_cast<T>(static_cast<float>(weight[d]) * static_cast<float>(normed));
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        const float e = radixlm::exp_nonpositive(-std::fabs(x));  // exp(-|x|): never overflows
        const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[i] = static_cast<T>(x * sig * static_cast<float>(u[i]));
      }
    }
  });
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the
// sigmoid as silu_mul_rows computes it, from exp(-|2u|), which never overflows.
template <typename T>
void gelu_tanh_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        const float z = kTwoSqrtTwoOverPi * (x + 0.044715f * x * x * x);
        const float e = radixlm::exp_nonpositive(-std::fabs(z));
        const float sig = (z >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[i] = static_cast<T>(x * sig * static_cast<float>(u[i]));
      }
    }
  });
}

template <typename T>
void rope_rows(const T* x, int64_t row_stride, const float* cos, const float* sin, T* out, int64_t tokens,
               int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = x + t * row_stride + h * dim;
        T* o = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xi[i]), x2 = static_cast<float>(xi[i + half]);
          o[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          o[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

// RMSNorm of x [T, H] (or of x + residual, when residual is given); returns (sum or x, normed).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps) {
  auto xc = x.contiguous();
  check_rows(xc, "x");
  TORCH_CHECK(weight.scalar_type() == xc.scalar_type() && weight.numel() == xc.size(1), "weight must be [H] in x's dtype");
  auto wc = weight.contiguous();
  torch::Tensor rc, sum = xc;
  if (residual.has_value()) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.sizes() == xc.sizes() && rc.scalar_type() == xc.scalar_type(), "residual must match x");
    sum = torch::empty_like(xc);
  }
  auto out = torch::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), rc.defined() ? rc.data_ptr<scalar_t>() : nullptr,
                                wc.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.size(0),
                                xc.size(1), static_cast<float>(eps));
  });
  return {sum, out};
}

// silu(gate) * up for gate_up [T, 2I] (gate first); returns [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  auto gc = gate_up.contiguous();
  check_rows(gc, "gate_up");
  TORCH_CHECK(gc.size(1) % 2 == 0, "gate_up must have an even last dimension");
  const int64_t inter = gc.size(1) / 2;
  auto out = torch::empty({gc.size(0), inter}, gc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gc.size(0), inter);
  });
  return out;
}

// gelu(gate, approximate='tanh') * up for gate_up [T, 2I] (gate first); returns [T, I].
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  auto gc = gate_up.contiguous();
  check_rows(gc, "gate_up");
  TORCH_CHECK(gc.size(1) % 2 == 0, "gate_up must have an even last dimension");
  const int64_t inter = gc.size(1) / 2;
  auto out = torch::empty({gc.size(0), inter}, gc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc.scalar_type(), "gelu_tanh_mul", [&] {
    gelu_tanh_mul_rows<scalar_t>(gc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gc.size(0), inter);
  });
  return out;
}

// Rotate-half RoPE of x [T, heads, D] (rows may be strided, heads contiguous) with fp32 cos/sin
// [T, D/2]; returns a contiguous [T, heads, D].
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "x must be a CPU tensor [T, heads, D]");
  auto xc = (x.stride(2) == 1 && x.stride(1) == x.size(2)) ? x : x.contiguous();
  auto cc = cos.to(torch::kFloat).contiguous(), sc = sin.to(torch::kFloat).contiguous();
  const int64_t tokens = xc.size(0), heads = xc.size(1), dim = xc.size(2);
  TORCH_CHECK(dim % 2 == 0 && cc.numel() == tokens * dim / 2 && sc.numel() == cc.numel(), "cos/sin must be [T, D/2]");
  auto out = torch::empty({tokens, heads, dim}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(xc.data_ptr<scalar_t>(), xc.stride(0), cc.data_ptr<float>(), sc.data_ptr<float>(),
                        out.data_ptr<scalar_t>(), tokens, heads, dim);
  });
  return out;
}
