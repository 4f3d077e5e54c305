// Grouped low-rank LoRA deltas on the CPU: every segment of tokens adds its own adapter's
// (x @ A.T) @ B.T to its rows of a projection's output, in one call per projection.
//
// A segment is a run [start, end) of the flat token axis that uses one adapter. Its adapter gives
// A transposed, [in, R] (the ranks of every part it targets side by side, zero columns padding R
// to a multiple of 16), and per output part of the module (q/k/v of a fused qkv projection, or
// the whole output) B transposed, [r, n], or nothing where it leaves that part alone. Two
// phases, each split over the intra-op threads:
//   shrink: h[t, :] = x[t] @ A                        one pass over A per block of tokens
//   expand: out[t, lo:lo+n] += h[t, col:col+r] @ B    one pass over B per block of tokens
// Both are one register tile: 16 columns for up to 8 tokens, summed over the shared depth.
// The adapters' weights are read where they lie (no stacking or copies), fp32, bf16 or fp16;
// sums run in fp32 and the output is rounded once to its dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTokenBlock = 16;    // tokens of one shrink work item
constexpr int64_t kColumnChunk = 256;  // output columns of one expand work item
constexpr int kLanes = 16;             // columns of one register tile (one AVX-512 vector of floats)

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;  // a plain shift: compilers vectorize it
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half v) { return static_cast<float>(v); }

struct ShrinkItem {
  int64_t segment, t0, t1;
};
struct ExpandItem {
  int64_t segment, part, j0, j1;
};

// 16 floats: one AVX-512 register (two AVX2 ones), by the compiler's vector extension
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// `width` <= 16 values of row as floats, zeros past width (16 are one vector load: a value
// assembled lane by lane in memory and then loaded would stall the load)
template <typename B>
inline Lanes load_lanes(const B* row, int64_t width) {
  Lanes out;
  if constexpr (std::is_same_v<B, float>) {
    if (width == kLanes) {
      std::memcpy(&out, row, sizeof(out));
      return out;
    }
  } else if constexpr (std::is_same_v<B, c10::BFloat16>) {
    if (width == kLanes) {
      Halves bits;
      std::memcpy(&bits, row, sizeof(bits));
      const Words wide = __builtin_convertvector(bits, Words) << 16;  // bf16 is the top half of a float
      std::memcpy(&out, &wide, sizeof(out));
      return out;
    }
  }
  float v[kLanes];
  for (int j = 0; j < kLanes; ++j) v[j] = j < width ? to_float(row[j]) : 0.0f;
  std::memcpy(&out, v, sizeof(out));
  return out;
}

// the first `width` <= 16 lanes of v into row, rounded to its dtype
template <typename O>
inline void store_lanes(O* row, const Lanes& v, int64_t width) {
  if constexpr (std::is_same_v<O, float>) {
    if (width == kLanes) {
      std::memcpy(row, &v, sizeof(v));
      return;
    }
  }
  float f[kLanes];
  std::memcpy(f, &v, sizeof(f));
  for (int64_t j = 0; j < width; ++j) row[j] = static_cast<O>(f[j]);
}

// acc[t][j] = sum over k < depth of a[t * a_stride + k] * b[k * b_stride + j], for TB tokens and
// `width` <= 16 columns: each token's 16 sums stay in a register over the whole depth, and each
// b row is read once for the TB tokens.
template <int TB, typename A, typename B>
inline void tile(const A* __restrict a, int64_t a_stride, const B* __restrict b, int64_t b_stride, int64_t depth,
                 int64_t width, float* __restrict acc) {
  Lanes c[TB];
  for (int t = 0; t < TB; ++t) c[t] = Lanes{};
  for (int64_t k = 0; k < depth; ++k) {
    const Lanes w = load_lanes(b + k * b_stride, width);
    for (int t = 0; t < TB; ++t) c[t] += to_float(a[t * a_stride + k]) * w;
  }
  std::memcpy(acc, c, sizeof(c));
}

// h[t, :] = x[t] @ A for TB tokens, A transposed [in, R] with R a multiple of 16
template <int TB, typename W, typename X>
void shrink_tokens(const X* x, int64_t x_stride, const W* at, int64_t in, int64_t rank, float* h) {
  float acc[TB * kLanes];
  for (int64_t c = 0; c < rank; c += kLanes) {
    tile<TB>(x, x_stride, at + c, rank, in, kLanes, acc);
    for (int t = 0; t < TB; ++t) std::memcpy(h + t * rank + c, acc + t * kLanes, kLanes * sizeof(float));
  }
}

// out[t, j0:j1] += h[t, :r] @ B[:, j0:j1] for TB tokens, B transposed [r, n]: each token's 16
// outputs are loaded into a register, take the depth's sums and are stored back once
template <int TB, typename W, typename O>
void expand_tokens(const float* __restrict h, int64_t h_stride, const W* __restrict b, int64_t rank, int64_t n,
                   int64_t j0, int64_t j1, O* __restrict out, int64_t out_stride) {
  for (int64_t j = j0; j < j1; j += kLanes) {
    const int64_t width = std::min<int64_t>(kLanes, j1 - j);
    Lanes c[TB];
    for (int t = 0; t < TB; ++t) c[t] = load_lanes(out + t * out_stride + j, width);
    for (int64_t k = 0; k < rank; ++k) {
      const Lanes w = load_lanes(b + k * n + j, width);
      for (int t = 0; t < TB; ++t) c[t] += h[t * h_stride + k] * w;
    }
    for (int t = 0; t < TB; ++t) store_lanes(out + t * out_stride + j, c[t], width);
  }
}

// Calls f<TB>(first token, TB) over [t0, t1) in blocks of 8, then 4, 2 and 1 for the rest.
template <typename F>
void by_token_blocks(int64_t t0, int64_t t1, F&& f) {
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) f(std::integral_constant<int, 8>{}, t);
  if (t + 4 <= t1) f(std::integral_constant<int, 4>{}, t), t += 4;
  if (t + 2 <= t1) f(std::integral_constant<int, 2>{}, t), t += 2;
  if (t < t1) f(std::integral_constant<int, 1>{}, t);
}

template <typename W, typename X>
void lora_add_typed(const torch::Tensor& x, torch::Tensor& out, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& ends, const std::vector<torch::Tensor>& a,
                    const std::vector<torch::Tensor>& b, const std::vector<int64_t>& cols,
                    const std::vector<int64_t>& part_lo) {
  const int64_t segments = static_cast<int64_t>(starts.size());
  const int64_t parts = static_cast<int64_t>(part_lo.size());
  const int64_t in = x.size(1);
  // each segment's low-rank activations h, [tokens, R], one after another
  std::vector<int64_t> h_off(segments + 1, 0);
  std::vector<ShrinkItem> shrink;
  for (int64_t s = 0; s < segments; ++s) {
    h_off[s + 1] = h_off[s] + (ends[s] - starts[s]) * a[s].size(1);
    for (int64_t t = starts[s]; t < ends[s]; t += kTokenBlock) shrink.push_back({s, t, std::min(t + kTokenBlock, ends[s])});
  }
  std::vector<float> h(h_off[segments]);
  const X* xp = x.data_ptr<X>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const ShrinkItem& it = shrink[i];
      const int64_t rank = a[it.segment].size(1);
      const W* at = a[it.segment].data_ptr<W>();
      float* hs = h.data() + h_off[it.segment];  // the segment's first token's row
      by_token_blocks(it.t0, it.t1, [&](auto tb, int64_t t) {
        shrink_tokens<decltype(tb)::value>(xp + t * x_stride, x_stride, at, in, rank,
                                           hs + (t - starts[it.segment]) * rank);
      });
    }
  });
  std::vector<ExpandItem> expand;
  for (int64_t s = 0; s < segments; ++s) {
    for (int64_t p = 0; p < parts; ++p) {
      const torch::Tensor& bp = b[s * parts + p];
      if (bp.numel() == 0) continue;
      const int64_t n = bp.size(1);
      for (int64_t j = 0; j < n; j += kColumnChunk) expand.push_back({s, p, j, std::min(j + kColumnChunk, n)});
    }
  }
  X* op = out.data_ptr<X>();
  const int64_t out_stride = out.stride(0);
  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const ExpandItem& it = expand[i];
      const torch::Tensor& bp = b[it.segment * parts + it.part];
      const int64_t rank_all = a[it.segment].size(1);
      const float* hs = h.data() + h_off[it.segment] + cols[it.segment * parts + it.part];  // first token, this part's ranks
      const W* bw = bp.data_ptr<W>();
      X* o = op + part_lo[it.part];
      by_token_blocks(starts[it.segment], ends[it.segment], [&](auto tb, int64_t t) {
        expand_tokens<decltype(tb)::value>(hs + (t - starts[it.segment]) * rank_all, rank_all, bw, bp.size(0),
                                          bp.size(1), it.j0, it.j1, o + t * out_stride, out_stride);
      });
    }
  });
}

template <typename X>
void lora_add_dispatch_weights(const torch::Tensor& x, torch::Tensor& out, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& ends, const std::vector<torch::Tensor>& a,
                               const std::vector<torch::Tensor>& b, const std::vector<int64_t>& cols,
                               const std::vector<int64_t>& part_lo, c10::ScalarType wtype) {
  switch (wtype) {
    case torch::kFloat32:
      return lora_add_typed<float, X>(x, out, starts, ends, a, b, cols, part_lo);
    case torch::kBFloat16:
      return lora_add_typed<c10::BFloat16, X>(x, out, starts, ends, a, b, cols, part_lo);
    case torch::kFloat16:
      return lora_add_typed<c10::Half, X>(x, out, starts, ends, a, b, cols, part_lo);
    default:
      TORCH_CHECK(false, "lora_add: adapter weights must be float32, bfloat16 or float16, got ", wtype);
  }
}

}  // namespace

void lora_add(torch::Tensor x, torch::Tensor out, std::vector<int64_t> starts, std::vector<int64_t> ends,
              std::vector<torch::Tensor> a, std::vector<torch::Tensor> b, std::vector<int64_t> cols,
              std::vector<int64_t> part_lo) {
  const int64_t segments = static_cast<int64_t>(starts.size());
  const int64_t parts = static_cast<int64_t>(part_lo.size());
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "lora_add: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_add: x [n, in] and out [n, out] expected");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_add: x and out need contiguous rows");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_add: x and out must share a dtype");
  TORCH_CHECK(static_cast<int64_t>(ends.size()) == segments && static_cast<int64_t>(a.size()) == segments,
              "lora_add: one start, end and A per segment");
  TORCH_CHECK(static_cast<int64_t>(b.size()) == segments * parts && static_cast<int64_t>(cols.size()) == segments * parts,
              "lora_add: one B and column per segment and part");
  if (segments == 0) return;
  const c10::ScalarType wtype = a[0].scalar_type();
  for (int64_t s = 0; s < segments; ++s) {
    TORCH_CHECK(0 <= starts[s] && starts[s] <= ends[s] && ends[s] <= x.size(0), "lora_add: segment out of range");
    TORCH_CHECK(a[s].dim() == 2 && a[s].size(0) == x.size(1) && a[s].size(1) % kLanes == 0 && a[s].is_contiguous() &&
                    a[s].scalar_type() == wtype,
                "lora_add: A of each segment must be contiguous [in, R] of one dtype, R a multiple of 16");
    for (int64_t p = 0; p < parts; ++p) {
      const torch::Tensor& bp = b[s * parts + p];
      if (bp.numel() == 0) continue;
      const int64_t col = cols[s * parts + p];
      TORCH_CHECK(bp.dim() == 2 && bp.is_contiguous() && bp.scalar_type() == wtype, "lora_add: B parts must be contiguous [r, n] of A's dtype");
      TORCH_CHECK(col >= 0 && col + bp.size(0) <= a[s].size(1), "lora_add: a B part's ranks fall outside A");
      TORCH_CHECK(part_lo[p] >= 0 && part_lo[p] + bp.size(1) <= out.size(1), "lora_add: a B part falls outside out");
    }
  }
  switch (x.scalar_type()) {
    case torch::kFloat32:
      return lora_add_dispatch_weights<float>(x, out, starts, ends, a, b, cols, part_lo, wtype);
    case torch::kBFloat16:
      return lora_add_dispatch_weights<c10::BFloat16>(x, out, starts, ends, a, b, cols, part_lo, wtype);
    default:
      TORCH_CHECK(false, "lora_add: x must be float32 or bfloat16, got ", x.scalar_type());
  }
}
