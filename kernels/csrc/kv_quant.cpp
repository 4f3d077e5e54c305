// Quantize new keys or values into an 8-bit KV pool, one scale per (token, KV head), in one pass.
//
// The same arithmetic as radixlm.kernels.kv_quant.quantize (which GPUs and the fallback use):
// scale = fp16(max|x| / QMAX), clamped to [2^-24, 65504] and stepped up to the next fp16 when
// rounding took it below max|x| / QMAX; value = x / scale rounded to nearest-even (int8) or
// converted to fp8, clamped to +-QMAX. Doing it here costs one read of x instead of a dozen
// PyTorch ops per layer and step.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr float SCALE_MIN = 5.9604644775390625e-08f;  // 2^-24, the smallest fp16 step
constexpr float SCALE_MAX = 65504.0f;

// The fp16 scale of a head whose largest magnitude is amax.
inline c10::Half head_scale(float amax, float qmax) {
  c10::Half scale(std::min(std::max(amax / qmax, SCALE_MIN), SCALE_MAX));
  if (static_cast<float>(scale) * qmax < amax && static_cast<float>(scale) < SCALE_MAX) {
    scale = c10::Half(static_cast<uint16_t>(scale.x + 1), c10::Half::from_bits());  // the next fp16 up
  }
  return scale;
}

template <typename T, typename Q>
void quantize_rows(const T* x, const int64_t* slots, Q* values, c10::Half* scales, int64_t tokens, int64_t kv_heads,
                   int64_t dim, float qmax) {
  at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, h = task % kv_heads;
      const T* src = x + task * dim;
      float amax = 0.0f;
      for (int64_t d = 0; d < dim; ++d) {
        row[d] = static_cast<float>(src[d]);
        amax = std::max(amax, std::abs(row[d]));
      }
      const c10::Half scale = head_scale(amax, qmax);
      const float inv = static_cast<float>(scale);
      const int64_t at = slots[t] * kv_heads + h;
      scales[at] = scale;
      Q* dst = values + at * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float y = std::min(std::max(row[d] / inv, -qmax), qmax);
        if constexpr (std::is_same_v<Q, int8_t>) {
          dst[d] = static_cast<int8_t>(std::nearbyint(y));
        } else {
          dst[d] = static_cast<Q>(y);
        }
      }
    }
  });
}

}  // namespace

// x [T, Hkv, D] (fp32, bf16 or fp16); slots [T] int64; values [N, Hkv, D] (int8 or fp8) and
// scales [N, Hkv] fp16, both contiguous: row slots[t] of each receives token t.
void quantize_into(torch::Tensor x, torch::Tensor slots, torch::Tensor values, torch::Tensor scales, double qmax) {
  TORCH_CHECK(x.device().is_cpu() && values.device().is_cpu(), "quantize_into runs on CPU tensors");
  TORCH_CHECK(x.dim() == 3 && values.dim() == 3 && x.size(1) == values.size(1) && x.size(2) == values.size(2),
              "x must be [T, Hkv, D] and values [N, Hkv, D]");
  TORCH_CHECK(values.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == values.size(0) * values.size(1),
              "values must be contiguous and scales contiguous fp16 [N, Hkv]");
  auto xc = x.contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(sl.numel() == xc.size(0), "one slot per token");
  const int64_t tokens = xc.size(0), kv_heads = xc.size(1), dim = xc.size(2);
  auto run = [&](auto value_tag) {
    using Q = decltype(value_tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quantize_into", [&] {
      quantize_rows<scalar_t, Q>(xc.data_ptr<scalar_t>(), sl.data_ptr<int64_t>(), values.data_ptr<Q>(),
                                 scales.data_ptr<c10::Half>(), tokens, kv_heads, dim, static_cast<float>(qmax));
    });
  };
  switch (values.scalar_type()) {
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "quantize_into: values must be int8 or fp8, got ", values.scalar_type());
  }
}
