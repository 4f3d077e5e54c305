// A Llama-family decoder stack for decode steps on CPUs: every layer of one step in one call.
//
// At batch 1 a decode step is mostly fixed cost: ~15 PyTorch ops a layer, each a Python call,
// a dispatch and an allocation, around matmuls that take a few microseconds each. This runs the
// same per-layer sequence from C++ (the same kernels the Python path calls, so the results are
// the same to the bit):
//
//   residual, h = add_rms_norm(x, residual)          (x itself for the first layer)
//   q, k, v     = split(h @ Wqkv.T (+ b)); q, k = rope(q), rope(k)
//   pool[slots] = k, v                                (converted or quantized to the pool's format)
//   p           = flash attention of each shared prefix's rows over it (cascade attention, as
//                 kernels/torch_decode.py's _prefix_parts computes it)
//   a           = paged_decode(q over the pool, continuing p)   (each row's positions [start, start + len))
//   residual, h = add_rms_norm(a @ Wo.T, residual)
//   x           = silu_mul(h @ Wgate_up.T) @ Wdown.T
//
// A linear layer's weight is Q4_1 tiles (uint8, q4_matmul.h's layout), a dense float32 matrix,
// or row parts of GGUF blocks (gguf_linear.cpp); only the fused q/k/v projection may have a bias.

#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

// y = x @ W.T (+ b), as Int4Linear (Q4_1 tiles, then the bias added), F.linear (float32) or
// GGUFLinear (GGUF parts, then the bias added) computes it.
struct Linear {
  std::vector<torch::Tensor> weight;  // without types: one tensor, uint8 Q4_1 tiles or float32 [n, K]; with: the GGUF parts
  std::vector<int64_t> types;         // the GGUF parts' type ids (empty for the other two kinds)
  int64_t n;
  c10::optional<torch::Tensor> bias;

  Linear(std::vector<torch::Tensor> w, std::vector<int64_t> t, int64_t out_features, c10::optional<torch::Tensor> b = c10::nullopt)
      : weight(std::move(w)), types(std::move(t)), n(out_features), bias(std::move(b)) {
    if (types.empty()) {
      TORCH_CHECK(weight.size() == 1, "a decode-stack weight without GGUF types must be one tensor");
      const auto& w0 = weight[0];
      TORCH_CHECK(w0.device().is_cpu() && w0.dim() == 2, "a decode-stack weight must be a 2-D CPU tensor");
      TORCH_CHECK(w0.scalar_type() == torch::kUInt8 || (w0.scalar_type() == torch::kFloat && w0.size(0) == n),
                  "a decode-stack weight must be Q4_1 tiles (uint8) or float32 [n, K]");
    } else {
      TORCH_CHECK(weight.size() == types.size(), "a GGUF decode-stack weight needs one type per part");
      int64_t rows = 0;
      for (const auto& p : weight) {
        TORCH_CHECK(p.device().is_cpu() && p.dim() == 2 && p.scalar_type() == torch::kUInt8,
                    "a GGUF decode-stack part must be a 2-D uint8 CPU tensor of blocks");
        rows += p.size(0);
      }
      TORCH_CHECK(rows == n, "the GGUF parts have ", rows, " rows in all, not n = ", n);
    }
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == n, "a bias must be float32 [n]");
    }
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (types.empty() && weight[0].scalar_type() == torch::kFloat) return at::linear(x, weight[0], bias);
    auto y = types.empty() ? q4_linear(x, weight[0], n) : gguf_linear(x, weight, types, n);
    return bias.has_value() ? y + *bias : y;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  }

  // Append a layer; each weight is its tensors, their GGUF type ids and its output count n: one
  // tensor and no types (uint8 Q4_1 tiles, or float32 [n, K]), or GGUF row parts and their types.
  void add_layer(torch::Tensor input_norm, std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_types, int64_t qkv_n,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o, std::vector<int64_t> o_types,
                 int64_t o_n, torch::Tensor post_norm, std::vector<torch::Tensor> gate_up,
                 std::vector<int64_t> gate_up_types, int64_t gate_up_n, std::vector<torch::Tensor> down,
                 std::vector<int64_t> down_types, int64_t down_n) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv_n == q_size + 2 * kv_size, "qkv must have heads * head_dim + 2 * kv_heads * head_dim outputs");
    TORCH_CHECK(gate_up_n % 2 == 0, "gate_up must have an even number of outputs");
    TORCH_CHECK(input_norm.scalar_type() == torch::kFloat && post_norm.scalar_type() == torch::kFloat,
                "the norms' weights must be float32");
    TORCH_CHECK(input_norm.numel() == post_norm.numel(), "the two norms must have the hidden size");
    layers_.push_back(Layer{input_norm, post_norm, Linear(std::move(qkv), std::move(qkv_types), qkv_n, qkv_bias),
                            Linear(std::move(o), std::move(o_types), o_n),
                            Linear(std::move(gate_up), std::move(gate_up_types), gate_up_n),
                            Linear(std::move(down), std::move(down_types), down_n)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] float32 (the embeddings of B decode tokens); cos/sin [B, D/2] float32;
  // k_pools/v_pools: one [N, Hkv, D] tensor a layer (any dtype paged_decode reads), k_scales /
  // v_scales: their fp16 [N, Hkv] scales for 8-bit pools (qmax: the format's largest code);
  // slots [B]: where the new KV goes; table/rows/starts/lens as for paged_decode (each row's
  // positions to attend after its shared prefix, the new token included); prefix_rows /
  // prefix_slots / prefix_starts: the shared prefixes (the rows of each, its slots, its first
  // slot when they are contiguous, else -1; they need a pool in x's dtype). Returns (x,
  // residual) after the last layer.
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                     const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                     const std::vector<c10::optional<torch::Tensor>>& k_scales,
                                     const std::vector<c10::optional<torch::Tensor>>& v_scales, double qmax,
                                     torch::Tensor slots, torch::Tensor table, torch::Tensor rows, torch::Tensor starts,
                                     torch::Tensor lens, int64_t splits, const std::vector<torch::Tensor>& prefix_rows,
                                     const std::vector<torch::Tensor>& prefix_slots,
                                     const std::vector<int64_t>& prefix_starts) const {
    const int64_t n_layers = num_layers();
    TORCH_CHECK(n_layers > 0, "the decode stack has no layers");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [B, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == n_layers && static_cast<int64_t>(v_pools.size()) == n_layers &&
                    static_cast<int64_t>(k_scales.size()) == n_layers && static_cast<int64_t>(v_scales.size()) == n_layers,
                "one K and V pool (and scale entry) per layer");
    const int64_t b = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(slots.numel() == b && rows.numel() == b && lens.numel() == b && starts.numel() == b,
                "one slot, table row, start and length per token");
    auto slot_index = slots.to(torch::kLong).contiguous();
    TORCH_CHECK(prefix_rows.size() == prefix_slots.size() && prefix_rows.size() == prefix_starts.size(),
                "one row set, slot list and start per shared prefix");
    std::vector<Prefix> prefixes;
    for (size_t g = 0; g < prefix_rows.size(); ++g) prefixes.push_back(Prefix{prefix_rows[g], prefix_slots[g], prefix_starts[g]});
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    torch::Tensor residual;
    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& layer = layers_[i];
      auto normed = add_rms_norm(x, residual.defined() ? c10::optional<torch::Tensor>(residual) : c10::nullopt,
                                 layer.input_norm, eps_);
      residual = normed[0];
      auto qkv = layer.qkv(normed[1]);
      auto q = rope(qkv.narrow(1, 0, q_size).view({b, heads_, head_dim_}), cos, sin);
      auto k = rope(qkv.narrow(1, q_size, kv_size).view({b, kv_heads_, head_dim_}), cos, sin);
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({b, kv_heads_, head_dim_});
      store(k, k_pools[i], k_scales[i], slot_index, qmax);
      store(v, v_pools[i], v_scales[i], slot_index, qmax);
      c10::optional<torch::Tensor> init_out, init_lse;
      prefix_parts(q, k_pools[i], v_pools[i], prefixes, scale, init_out, init_lse);
      auto attn = paged_decode(q, k_pools[i], v_pools[i], table, rows, starts, lens, scale, init_out, init_lse,
                               k_scales[i], v_scales[i], splits)[0];
      normed = add_rms_norm(layer.o(attn.view({b, q_size})), residual, layer.post_norm, eps_);
      residual = normed[0];
      x = layer.down(silu_mul(layer.gate_up(normed[1])));
    }
    return {x, residual};
  }

 private:
  struct Prefix {
    torch::Tensor rows, slots;  // rows: indices of the query rows that share it; slots: its slots
    int64_t start;              // its first slot when contiguous, else -1
  };

  // Each shared prefix attended once by all its rows' queries q [B, H, D]: the normalized output
  // and log-sum-exp every row's own part continues (left unset when there is no prefix).
  void prefix_parts(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                    const std::vector<Prefix>& prefixes, double scale, c10::optional<torch::Tensor>& init_out,
                    c10::optional<torch::Tensor>& init_lse) const {
    if (prefixes.empty()) return;
    TORCH_CHECK(k_pool.scalar_type() == q.scalar_type(), "shared prefixes need a pool in the activations' dtype");
    const int64_t b = q.size(0), group = heads_ / kv_heads_;
    auto qd = q.view({b, kv_heads_, group, head_dim_});
    torch::Tensor out, lse;
    for (const Prefix& p : prefixes) {
      const int64_t n = p.rows.numel();
      auto kp = p.start >= 0 ? k_pool.narrow(0, p.start, p.slots.numel()) : k_pool.index_select(0, p.slots);
      auto vp = p.start >= 0 ? v_pool.narrow(0, p.start, p.slots.numel()) : v_pool.index_select(0, p.slots);
      auto rows_q = n == b ? qd : qd.index_select(0, p.rows);
      auto qg = rows_q.permute({1, 0, 2, 3}).reshape({1, kv_heads_, n * group, head_dim_});
      auto parts = at::_scaled_dot_product_flash_attention_for_cpu(qg, kp.transpose(0, 1).unsqueeze(0),
                                                                  vp.transpose(0, 1).unsqueeze(0), 0.0, false,
                                                                  c10::nullopt, scale);
      auto o2 = std::get<0>(parts).view({kv_heads_, n, group, head_dim_}).transpose(0, 1);
      auto lse2 = std::get<1>(parts).unsqueeze(-1).view({kv_heads_, n, group, 1}).transpose(0, 1);
      if (prefixes.size() == 1 && n == b) {  // one prefix shared by every row (in order)
        out = o2;
        lse = lse2;
        break;
      }
      if (!out.defined()) {
        out = torch::zeros({b, kv_heads_, group, head_dim_}, q.options().dtype(torch::kFloat));
        lse = torch::full({b, kv_heads_, group, 1}, -std::numeric_limits<float>::infinity(), q.options().dtype(torch::kFloat));
      }
      out.index_put_({p.rows}, o2.to(torch::kFloat));
      lse.index_put_({p.rows}, lse2);
    }
    init_out = out;
    init_lse = lse;
  }

  // Write the new tokens' keys (or values) [B, Hkv, D] into the pool at slots.
  static void store(const torch::Tensor& x, const torch::Tensor& pool, const c10::optional<torch::Tensor>& scales,
                    const torch::Tensor& slots, double qmax) {
    if (scales.has_value()) {
      quantize_into(x, slots, pool, *scales, qmax);
    } else {
      pool.index_copy_(0, slots, x.scalar_type() == pool.scalar_type() ? x : x.to(pool.scalar_type()));
    }
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeStack>(m, "DecodeStack", "A Llama-family decoder stack for decode steps, every layer in one call")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"))
      .def("add_layer", &DecodeStack::add_layer,
           "Append a layer (each weight: [Q4_1 tiles] or [float32 [n, K]] with no types, or GGUF parts and their type ids)",
           py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_n"), py::arg("qkv_bias"), py::arg("o"),
           py::arg("o_types"), py::arg("o_n"), py::arg("post_norm"), py::arg("gate_up"), py::arg("gate_up_types"),
           py::arg("gate_up_n"), py::arg("down"), py::arg("down_types"), py::arg("down_n"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, "Every layer for B decode tokens; returns (x, residual)", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("k_pools"), py::arg("v_pools"), py::arg("k_scales"),
           py::arg("v_scales"), py::arg("qmax"), py::arg("slots"), py::arg("table"), py::arg("rows"), py::arg("starts"),
           py::arg("lens"), py::arg("splits"), py::arg("prefix_rows"), py::arg("prefix_slots"), py::arg("prefix_starts"));
}
