// GGUF's quantized block formats as torch entry points: y = x @ W.T with W's rows kept as the
// file's blocks (gguf_blocks.h), and the exact dequantization of selected rows (embeddings).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <string>

#include "gguf_blocks.h"
#include "kernels.h"

namespace {

std::string supported_list() {
  std::string out;
  for (int t : radixlm::gguf::kTypes) out += (out.empty() ? "" : ", ") + std::to_string(t);
  return out;
}

// (weights, bytes) of one block of ``type``, refusing an unsupported type by name.
std::pair<int64_t, int64_t> checked_shape(const char* op, int64_t type) {
  int64_t weights = 0, bytes = 0;
  radixlm::gguf::block_shape(static_cast<int>(type), weights, bytes);
  TORCH_CHECK(weights > 0, op, ": unsupported GGUF type ", type, " (supported type ids: ", supported_list(), ")");
  return {weights, bytes};
}

}  // namespace

// x [M, K] float32; parts[i] uint8 [n_i, K / block_weights * block_bytes] of types[i]; the
// weight is the parts stacked along rows (sum n_i == n) -> y [M, n] float32.
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types, int64_t n) {
  using namespace radixlm;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "gguf_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "gguf_linear: one type per part (got ", parts.size(),
              " parts and ", types.size(), " types)");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % gguf::kGroup == 0, "gguf_linear: K = ", k, " must be a multiple of 32");
  std::vector<int64_t> offsets(parts.size() + 1, 0);
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto [weights, bytes] = checked_shape("gguf_linear", types[i]);
    TORCH_CHECK(k % weights == 0, "gguf_linear: K = ", k, " must be a multiple of ", weights, " for type ", types[i]);
    auto& p = parts[i];
    TORCH_CHECK(p.device().is_cpu() && p.dim() == 2 && p.scalar_type() == torch::kUInt8,
                "gguf_linear: part ", i, " must be a 2-D uint8 CPU tensor of blocks");
    TORCH_CHECK(p.size(1) == k / weights * bytes, "gguf_linear: part ", i, " (type ", types[i], ") has rows of ",
                p.size(1), " bytes; K = ", k, " takes ", k / weights * bytes, " bytes");
    p = p.contiguous();
    offsets[i + 1] = offsets[i] + p.size(0);
  }
  TORCH_CHECK(offsets.back() == n, "gguf_linear: the parts have ", offsets.back(), " rows in all, not n = ", n);
  x = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  auto scratch = torch::empty({gguf::scratch_bytes(m, k)}, x.options().dtype(torch::kUInt8));
  gguf::quantize_into(x.data_ptr<float>(), m, k, scratch.data_ptr<uint8_t>());
  const uint8_t* sp = scratch.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // output rows of all parts in one range, so that threads share a fused projection evenly
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(begin, offsets[i]), hi = std::min(end, offsets[i + 1]);
      if (lo >= hi) continue;
      gguf::matmul_rows(static_cast<int>(types[i]), parts[i].data_ptr<uint8_t>(), lo - offsets[i], hi - offsets[i], sp, m,
                        k, yp + offsets[i], n);
    }
  });
  return y;
}

// blocks uint8 [N, K / block_weights * block_bytes] of ``type``, ids int64 [T] -> float32 [T, k]:
// the rows dequantized exactly as GGUF's dequantize does.
torch::Tensor gguf_dequantize_rows(torch::Tensor blocks, int64_t type, torch::Tensor ids, int64_t k) {
  using namespace radixlm;
  const auto [weights, bytes] = checked_shape("gguf_dequantize_rows", type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8,
              "gguf_dequantize_rows: blocks must be a 2-D uint8 CPU tensor");
  TORCH_CHECK(k > 0 && k % weights == 0, "gguf_dequantize_rows: k = ", k, " must be a multiple of ", weights, " for type ", type);
  TORCH_CHECK(blocks.size(1) == k / weights * bytes, "gguf_dequantize_rows: rows of ", blocks.size(1),
              " bytes, but k = ", k, " takes row_bytes = ", k / weights * bytes);
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1, "gguf_dequantize_rows: ids must be a 1-D CPU tensor");
  blocks = blocks.contiguous();
  auto idx = ids.to(torch::kLong).contiguous();
  const int64_t t = idx.numel(), rows = blocks.size(0), row_bytes = blocks.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "gguf_dequantize_rows: id ", ip[i], " out of range for ", rows, " rows");
  }
  auto out = torch::empty({t, k}, torch::dtype(torch::kFloat32));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) gguf::dequantize_row(static_cast<int>(type), bp + ip[i] * row_bytes, k, op + i * k);
  });
  return out;
}

// The type ids gguf_linear and gguf_dequantize_rows take.
std::vector<int64_t> gguf_native_types() {
  return std::vector<int64_t>(std::begin(radixlm::gguf::kTypes), std::end(radixlm::gguf::kTypes));
}

// One token's routed experts over GGUF blocks, as runtime/layers/moe.py's _one_token computes them
// with GGUFLinear experts, in one call: out = 0, then out += down_j(act(gate_up_j(x))) * weights[j]
// for j in the order given (ascending expert id). The k gate/up projections share x, so they run
// as one gguf_linear over all their parts (each row's sums do not depend on the others), the
// activation over the k rows at once; then each expert's down projection of its own row, all k
// in one parallel range (one fork and join, not k). x [1, H]
// float32; gate_up[j], down[j]: expert j's row parts (uint8 blocks) with their types; weights [k]
// float32; gelu: GELU-tanh instead of SiLU. Returns [1, H].
torch::Tensor gguf_experts_token(torch::Tensor x, std::vector<std::vector<torch::Tensor>> gate_up,
                                 std::vector<std::vector<int64_t>> gate_up_types, std::vector<std::vector<torch::Tensor>> down,
                                 std::vector<std::vector<int64_t>> down_types, torch::Tensor weights, bool gelu) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == torch::kFloat32,
              "gguf_experts_token: x must be one float32 CPU row [1, H]");
  const int64_t k = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(k > 0 && gate_up_types.size() == gate_up.size() && down.size() == gate_up.size() &&
                  down_types.size() == gate_up.size(),
              "gguf_experts_token: gate_up, gate_up_types, down and down_types need one entry per expert");
  TORCH_CHECK(weights.dim() == 1 && weights.numel() == k && weights.scalar_type() == torch::kFloat32,
              "gguf_experts_token: weights must be float32 [k] (k = ", k, ")");
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> types;
  int64_t rows = -1;
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(gate_up[j].size() == gate_up_types[j].size(), "gguf_experts_token: expert ", j, "'s gate/up needs one type per part");
    int64_t n = 0;
    for (size_t i = 0; i < gate_up[j].size(); ++i) {
      parts.push_back(gate_up[j][i]);
      types.push_back(gate_up_types[j][i]);
      n += gate_up[j][i].size(0);
    }
    TORCH_CHECK(rows < 0 || n == rows, "gguf_experts_token: the experts' gate/up projections differ in rows (", n, " and ", rows, ")");
    rows = n;
  }
  TORCH_CHECK(rows % 2 == 0, "gguf_experts_token: a gate/up projection has an odd number of rows (", rows, ")");
  const auto fused = gguf_linear(x, parts, types, k * rows).view({k, rows});
  const auto act = (gelu ? gelu_tanh_mul(fused) : silu_mul(fused)).contiguous();
  // the k down projections, each of its own row of act, in one parallel range over their k * H
  // output rows: each row quantized alone (as gguf_linear quantizes a one-row input), so every
  // output is the one gguf_linear(act[j], down[j]) gives
  using namespace radixlm;
  const int64_t h = x.size(1), inter = act.size(1);
  std::vector<std::vector<int64_t>> offsets(k);
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(down[j].size() == down_types[j].size() && !down[j].empty(), "gguf_experts_token: expert ", j, "'s down needs one type per part");
    offsets[j].push_back(0);
    for (size_t i = 0; i < down[j].size(); ++i) {
      const auto [bw, bb] = checked_shape("gguf_experts_token", down_types[j][i]);
      auto& p = down[j][i];
      TORCH_CHECK(p.device().is_cpu() && p.dim() == 2 && p.scalar_type() == torch::kUInt8 && inter % bw == 0 &&
                      p.size(1) == inter / bw * bb,
                  "gguf_experts_token: expert ", j, "'s down part ", i, " must be uint8 blocks of rows of ", inter, " weights");
      p = p.contiguous();
      offsets[j].push_back(offsets[j].back() + p.size(0));
    }
    TORCH_CHECK(offsets[j].back() == h, "gguf_experts_token: expert ", j, "'s down projection has ", offsets[j].back(),
                " rows, not H = ", h);
  }
  const int64_t row_scratch = (gguf::scratch_bytes(1, inter) + 63) / 64 * 64;  // each row's quantized copy 64-byte aligned
  auto scratch = torch::empty({k * row_scratch}, x.options().dtype(torch::kUInt8));
  uint8_t* sp = scratch.data_ptr<uint8_t>();
  const float* ap = act.data_ptr<float>();
  for (int64_t j = 0; j < k; ++j) gguf::quantize_into(ap + j * inter, 1, inter, sp + j * row_scratch);
  auto ys = torch::empty({k, h}, x.options());
  float* yp = ys.data_ptr<float>();
  at::parallel_for(0, k * h, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin / h; j < k && j * h < end; ++j) {
      for (size_t i = 0; i + 1 < offsets[j].size(); ++i) {
        const int64_t lo = std::max(begin - j * h, offsets[j][i]), hi = std::min(end - j * h, offsets[j][i + 1]);
        if (lo >= hi) continue;
        gguf::matmul_rows(static_cast<int>(down_types[j][i]), down[j][i].data_ptr<uint8_t>(), lo - offsets[j][i],
                          hi - offsets[j][i], sp + j * row_scratch, 1, inter, yp + j * h + offsets[j][i], h);
      }
    }
  });
  auto out = torch::zeros_like(x);
  for (int64_t j = 0; j < k; ++j) out.add_(ys.narrow(0, j, 1) * weights[j]);
  return out;
}
