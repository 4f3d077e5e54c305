// FP8 (e4m3) weight-only matrix multiplication: y = x @ (W * scale).T, with W the raw bytes of
// float8_e4m3fn values (as FP8 checkpoints store them) decoded in registers by fp8_matmul.h.
// Output rows are split over the intra-op threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fp8_matmul.h"

// x [M, K] float32, weight [N, K] uint8, scale float32 (1 value, N values, or [ceil(N / block_n),
// ceil(K / block_k)] when block_n, block_k > 0) -> y [M, N] float32.
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), "fp8_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "fp8_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 && weight.size(1) == x.size(1),
              "fp8_linear: weight must be uint8 [N, K] with x's K = ", x.size(1));
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "fp8_linear: scale must be float32");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  int64_t rows_per_scale, scale_stride, seg;
  if (block_n > 0 && block_k > 0) {
    const int64_t nb = (n + block_n - 1) / block_n, kb = (k + block_k - 1) / block_k;
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == nb && scale.size(1) == kb, "fp8_linear: block scales must be [", nb,
                ", ", kb, "] for a [", n, ", ", k, "] weight in ", block_n, "x", block_k, " blocks");
    rows_per_scale = block_n, scale_stride = kb, seg = block_k;
  } else {
    TORCH_CHECK(block_n == 0 && block_k == 0, "fp8_linear: block_n and block_k must both be positive, or both 0");
    TORCH_CHECK(scale.numel() == 1 || scale.numel() == n, "fp8_linear: scale must have 1 or N = ", n, " elements");
    rows_per_scale = scale.numel() == 1 ? n : 1, scale_stride = scale.numel() == 1 ? 0 : 1, seg = k;
  }
  x = x.contiguous();
  weight = weight.contiguous();
  scale = scale.contiguous();
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a grain of 16 rows keeps every thread busy even for the smallest projections
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    radixlm::fp8::matmul_rows(xp, m, k, wp, sp, rows_per_scale, scale_stride, seg, n, begin, end, yp);
  });
  return y;
}
