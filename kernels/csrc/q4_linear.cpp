// Weight-only 4-bit matrix multiplication for few rows (decode): y = x @ W.T, with W in the
// tiled Q4_1 layout of q4_matmul.h (built by runtime/layers/quantized_linear.q4_1_tiles), or its
// Q4_0 tiles (q4_0_tiles: told apart by their width). Tiles are split over the intra-op threads;
// many rows of x take gguf_blocks.h's interleaved kernel (the same sums in the same order).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gguf_blocks.h"

// x [M, K] float32, tiles [ceil(n / 4), K / 32 * 80] (Q4_1) or [ceil(n / 4), K / 32 * 72] (Q4_0)
// uint8 -> y [M, n] float32.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor tiles, int64_t n) {
  using namespace radixlm::q4;
  namespace gguf = radixlm::gguf;
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu(), "q4_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "q4_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == torch::kUInt8, "q4_linear: tiles must be a 2-D uint8 tensor");
  const int64_t m = x.size(0), k = x.size(1);
  const bool q4_0 = k % kGroup == 0 && tiles.size(1) == k / kGroup * kQ4_0TileBlockBytes;
  TORCH_CHECK(k % kGroup == 0 && (q4_0 || tiles.size(1) == k / kGroup * kTileBlockBytes) && tiles.size(0) == (n + kTile - 1) / kTile,
              "q4_linear: tiles must be [ceil(n / 4), K / 32 * 80] (Q4_1) or [ceil(n / 4), K / 32 * 72] (Q4_0) for x's K = ", k,
              " and n = ", n);
  x = x.contiguous();
  tiles = tiles.contiguous();
  auto scratch = torch::empty({gguf::scratch_bytes(m, k)}, x.options().dtype(torch::kUInt8));
  gguf::quantize_into(x.data_ptr<float>(), m, k, scratch.data_ptr<uint8_t>());
  auto y = torch::empty({m, n}, x.options());
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const uint8_t* sp = scratch.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // a grain of 4 tiles (16 rows) keeps every thread busy even for the smallest projections
  at::parallel_for(0, tiles.size(0), 4, [&](int64_t begin, int64_t end) {
#if defined(RADIXLM_GGUF_LANES)
    if (gguf::lanes_layout(m) && m >= gguf::kTileLanesMinRows) {
      gguf::matmul_tiles_lanes(wp, sp, m, k, n, begin, end, yp, q4_0);
      return;
    }
#endif
    matmul_tiles(wp, sp, m, k, n, begin, end, yp, q4_0);
  });
  return y;
}
