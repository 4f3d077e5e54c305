// A pre-norm decoder stack for decode steps on CPUs: every layer of one step in one call.
//
// At batch 1 a decode step is mostly fixed cost: ~15 PyTorch ops a layer, each a Python call,
// a dispatch and an allocation, around matmuls that take a few microseconds each. This runs the
// same per-layer sequence from C++ (the same kernels the Python path calls, so the results are
// the same to the bit):
//
//   residual, h = add_rms_norm(x, residual)          (x itself for the first layer)
//   q, k, v     = split(h @ Wqkv.T (+ b))
//   q, k        = q_norm(q), k_norm(k)                (optional: RMSNorm of each head, rows [B*H, D])
//   q, k        = rope(q), rope(k)                    (with the layer's table; none on a NoPE layer)
//   pool[slots] = k, v                                (converted or quantized to the pool's format)
//   p           = attention of each shared prefix's rows over it (cascade attention, as
//                 kernels/torch_decode.py's _prefix_parts computes it: flash, or soft-capped scores)
//   a, lse      = paged_decode(q over the pool, continuing p)   (each row's positions [start, start + len)
//                 of the layer's plan: its sliding window, if any; scores soft-capped if the layer says)
//   a           = a * sigmoid(lse - sinks)            (optional: attention sinks, per query head)
//   a           = attn_out_norm(a @ Wo.T)             (optional: Gemma's norm of the attention branch)
//   residual, h = add_rms_norm(a, residual)
//   x           = act_mul(h @ Wgate_up.T) @ Wdown.T   (act: silu, or gelu with the tanh approximation)
//   x           = mlp_out_norm(x)                     (optional: Gemma's norm of the MLP branch)
//
// Each step is the call the Python path makes (kernels/torch_decode.py, runtime/layers), with the
// same arguments in the same order, so the two agree to the bit.
//
// A linear layer's weight is Q4_1 tiles (uint8, q4_matmul.h's layout), a dense float32 matrix,
// or row parts of GGUF blocks (gguf_linear.cpp); only the fused q/k/v projection may have a bias.

#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <string>
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
                  "a decode-stack weight must be Q4_1 or Q4_0 tiles (uint8) or float32 [n, K]");
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

// An RMSNorm's weight (float32 [n]) and its epsilon; undefined weight: no norm there.
struct Norm {
  torch::Tensor weight;
  double eps = 0.0;

  bool defined() const { return weight.defined(); }

  // The normalized rows of x [rows, n] (as RMSNorm.forward computes a 2-D input).
  torch::Tensor operator()(const torch::Tensor& x) const { return add_rms_norm(x, c10::nullopt, weight, eps)[1]; }
};

struct Layer {
  Norm input_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  Linear qkv, o, gate_up, down;
  int64_t rope;  // index of the layer's (cos, sin) table, -1: no RoPE
  double scale, softcap;  // softcap 0: none
  c10::optional<torch::Tensor> sinks;  // float32 [H], or none
  bool gelu;  // gelu_tanh_mul instead of silu_mul
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  }

  // Append a layer. norms/eps: the RMSNorms' weights (float32; None where the layer has none) and
  // epsilons, in the order input, post-attention (pre-MLP), q, k, attention-output, MLP-output;
  // the first two are required. Each weight is its tensors, their GGUF type ids and its output
  // count n: one tensor and no types (uint8 Q4_1 tiles, or float32 [n, K]), or GGUF row parts and
  // their types. rope: the index of the layer's (cos, sin) table in forward's lists, -1 for none;
  // scale multiplies q.k; softcap > 0 soft-caps the scores; sinks: float32 [heads] logits;
  // activation: "silu" or "gelu_tanh".
  void add_layer(const std::vector<c10::optional<torch::Tensor>>& norms, const std::vector<double>& eps,
                 std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_types, int64_t qkv_n,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o, std::vector<int64_t> o_types,
                 int64_t o_n, std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types, int64_t gate_up_n,
                 std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t down_n, int64_t rope,
                 double scale, double softcap, c10::optional<torch::Tensor> sinks, const std::string& activation) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv_n == q_size + 2 * kv_size, "qkv must have heads * head_dim + 2 * kv_heads * head_dim outputs");
    TORCH_CHECK(gate_up_n % 2 == 0, "gate_up must have an even number of outputs");
    TORCH_CHECK(norms.size() == 6 && eps.size() == 6, "six norm entries (input, post, q, k, attn_out, mlp_out) and their eps");
    TORCH_CHECK(norms[0].has_value() && norms[1].has_value(), "the input and post-attention norms are required");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ", activation);
    TORCH_CHECK(rope >= -1, "rope must be a table index or -1");
    TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
    const int64_t hidden = norms[0]->numel();
    const int64_t sizes[6] = {hidden, hidden, head_dim_, head_dim_, hidden, hidden};
    Norm parsed[6];
    for (int i = 0; i < 6; ++i) {
      if (!norms[i].has_value()) continue;
      TORCH_CHECK(norms[i]->scalar_type() == torch::kFloat && norms[i]->numel() == sizes[i],
                  "norm ", i, " must be float32 [", sizes[i], "]");
      parsed[i] = Norm{*norms[i], eps[i]};
    }
    if (sinks.has_value()) {
      TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->numel() == heads_, "sinks must be float32 [heads]");
    }
    layers_.push_back(Layer{parsed[0], parsed[1], parsed[2], parsed[3], parsed[4], parsed[5],
                            Linear(std::move(qkv), std::move(qkv_types), qkv_n, qkv_bias),
                            Linear(std::move(o), std::move(o_types), o_n),
                            Linear(std::move(gate_up), std::move(gate_up_types), gate_up_n),
                            Linear(std::move(down), std::move(down_types), down_n), rope, scale, softcap, sinks,
                            activation == "gelu_tanh"});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] float32 (the embeddings of B decode tokens); cos/sin: the RoPE tables, each
  // [B, D/2] float32, that layers name by index; k_pools/v_pools: one [N, Hkv, D] tensor a layer
  // (any dtype paged_decode reads), k_scales / v_scales: their fp16 [N, Hkv] scales for 8-bit
  // pools (qmax: the format's largest code); slots [B]: where the new KV goes; table/rows as for
  // paged_decode. The plans (one entry each in the plan_* lists): plan_starts/plan_lens [B] each
  // row's positions to attend after its shared prefixes (the new token included), plan_splits the
  // chunks a row is cut into, prefix_rows / prefix_slots / prefix_starts the shared prefixes (the
  // rows of each, its slots, its first slot when they are contiguous, else -1; they need a pool in
  // x's dtype). layer_plans: the plan of each layer. Returns (x, residual) after the last layer.
  std::vector<torch::Tensor> forward(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                     const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& k_pools,
                                     const std::vector<torch::Tensor>& v_pools,
                                     const std::vector<c10::optional<torch::Tensor>>& k_scales,
                                     const std::vector<c10::optional<torch::Tensor>>& v_scales, double qmax,
                                     torch::Tensor slots, torch::Tensor table, torch::Tensor rows,
                                     const std::vector<torch::Tensor>& plan_starts,
                                     const std::vector<torch::Tensor>& plan_lens, const std::vector<int64_t>& plan_splits,
                                     const std::vector<std::vector<torch::Tensor>>& prefix_rows,
                                     const std::vector<std::vector<torch::Tensor>>& prefix_slots,
                                     const std::vector<std::vector<int64_t>>& prefix_starts,
                                     const std::vector<int64_t>& layer_plans) const {
    const int64_t n_layers = num_layers();
    TORCH_CHECK(n_layers > 0, "the decode stack has no layers");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [B, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == n_layers && static_cast<int64_t>(v_pools.size()) == n_layers &&
                    static_cast<int64_t>(k_scales.size()) == n_layers && static_cast<int64_t>(v_scales.size()) == n_layers,
                "one K and V pool (and scale entry) per layer");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    TORCH_CHECK(static_cast<int64_t>(layer_plans.size()) == n_layers, "one plan index per layer");
    const int64_t b = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(slots.numel() == b && rows.numel() == b, "one slot and table row per token");
    const std::vector<Plan> plans = make_plans(b, plan_starts, plan_lens, plan_splits, prefix_rows, prefix_slots, prefix_starts);
    auto slot_index = slots.to(torch::kLong).contiguous();
    torch::Tensor residual;
    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(layer.rope < static_cast<int64_t>(cos.size()), "layer ", i, " uses RoPE table ", layer.rope, " of ", cos.size());
      TORCH_CHECK(layer_plans[i] >= 0 && layer_plans[i] < static_cast<int64_t>(plans.size()), "layer ", i, " has no plan");
      const Plan& plan = plans[layer_plans[i]];
      auto normed = add_rms_norm(x, residual.defined() ? c10::optional<torch::Tensor>(residual) : c10::nullopt,
                                 layer.input_norm.weight, layer.input_norm.eps);
      residual = normed[0];
      auto qkv = layer.qkv(normed[1]);
      auto q = head_norm(qkv.narrow(1, 0, q_size).view({b, heads_, head_dim_}), layer.q_norm);
      auto k = head_norm(qkv.narrow(1, q_size, kv_size).view({b, kv_heads_, head_dim_}), layer.k_norm);
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({b, kv_heads_, head_dim_});
      if (layer.rope >= 0) {
        q = ::rope(q, cos[layer.rope], sin[layer.rope]);
        k = ::rope(k, cos[layer.rope], sin[layer.rope]);
      }
      store(k, k_pools[i], k_scales[i], slot_index, qmax);
      store(v, v_pools[i], v_scales[i], slot_index, qmax);
      c10::optional<torch::Tensor> init_out, init_lse;
      prefix_parts(q, k_pools[i], v_pools[i], plan.prefixes, layer.scale, layer.softcap, init_out, init_lse);
      auto attn = paged_decode(q, k_pools[i], v_pools[i], table, rows, plan.starts, plan.lens, layer.scale, init_out,
                               init_lse, k_scales[i], v_scales[i], plan.splits, layer.softcap);
      auto a = attn[0];
      if (layer.sinks.has_value()) a = a * at::sigmoid(attn[1] - *layer.sinks).unsqueeze(-1);
      a = layer.o(a.view({b, q_size}));
      if (layer.attn_out_norm.defined()) a = layer.attn_out_norm(a);
      normed = add_rms_norm(a, residual, layer.post_norm.weight, layer.post_norm.eps);
      residual = normed[0];
      auto gate_up = layer.gate_up(normed[1]);
      x = layer.down(layer.gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up));
      if (layer.mlp_out_norm.defined()) x = layer.mlp_out_norm(x);
    }
    return {x, residual};
  }

 private:
  struct Prefix {
    torch::Tensor rows, slots;  // rows: indices of the query rows that share it; slots: its slots
    int64_t start;              // its first slot when contiguous, else -1
  };

  // The positions one layer's attention reads: each query row's [start, start + len) of its table
  // row (its sliding window, or what follows its shared prefix), in `splits` chunks, and the
  // shared prefixes attended first.
  struct Plan {
    torch::Tensor starts, lens;
    int64_t splits;
    std::vector<Prefix> prefixes;
  };

  static std::vector<Plan> make_plans(int64_t b, const std::vector<torch::Tensor>& starts,
                                      const std::vector<torch::Tensor>& lens, const std::vector<int64_t>& splits,
                                      const std::vector<std::vector<torch::Tensor>>& prefix_rows,
                                      const std::vector<std::vector<torch::Tensor>>& prefix_slots,
                                      const std::vector<std::vector<int64_t>>& prefix_starts) {
    const size_t n = starts.size();
    TORCH_CHECK(lens.size() == n && splits.size() == n && prefix_rows.size() == n && prefix_slots.size() == n &&
                    prefix_starts.size() == n,
                "every plan needs its starts, lens, splits and shared prefixes");
    std::vector<Plan> plans;
    for (size_t p = 0; p < n; ++p) {
      TORCH_CHECK(starts[p].numel() == b && lens[p].numel() == b, "a plan has one start and length per token");
      TORCH_CHECK(prefix_rows[p].size() == prefix_slots[p].size() && prefix_rows[p].size() == prefix_starts[p].size(),
                  "one row set, slot list and start per shared prefix");
      Plan plan{starts[p], lens[p], splits[p], {}};
      for (size_t g = 0; g < prefix_rows[p].size(); ++g) {
        plan.prefixes.push_back(Prefix{prefix_rows[p][g], prefix_slots[p][g], prefix_starts[p][g]});
      }
      plans.push_back(std::move(plan));
    }
    return plans;
  }

  // x [B, heads, D] with each head's RMSNorm applied (rows [B * heads, D]), or x itself without one.
  static torch::Tensor head_norm(const torch::Tensor& x, const Norm& norm) {
    if (!norm.defined()) return x;
    return norm(x.reshape({x.size(0) * x.size(1), x.size(2)})).view(x.sizes());
  }

  // Each shared prefix attended once by all its rows' queries q [B, H, D]: the normalized output
  // and log-sum-exp every row's own part continues (left unset when there is no prefix).
  void prefix_parts(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                    const std::vector<Prefix>& prefixes, double scale, double softcap,
                    c10::optional<torch::Tensor>& init_out, c10::optional<torch::Tensor>& init_lse) const {
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
      auto parts = attend(qg, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), scale, softcap);
      auto o2 = parts[0].view({kv_heads_, n, group, head_dim_}).transpose(0, 1);
      auto lse2 = parts[1].view({kv_heads_, n, group, 1}).transpose(0, 1);
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

  // Softmax attention of q [1, Hkv, Q, D] over k/v [1, Hkv, L, D]: (output, lse [1, Hkv, Q, 1]),
  // as torch_decode._partial computes it (no mask): PyTorch's flash kernel, or with soft-capped
  // scores the same matmul, tanh, logsumexp and exp.
  static std::vector<torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           double scale, double softcap) {
    if (softcap == 0.0) {
      auto parts = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, c10::nullopt, scale);
      return {std::get<0>(parts), std::get<1>(parts).unsqueeze(-1)};
    }
    auto scores = at::matmul(q, k.transpose(-1, -2)) * scale;
    scores = at::tanh(scores / softcap) * softcap;
    auto lse = at::logsumexp(scores, {-1}, true);
    return {at::matmul(at::exp(scores - lse), v), lse};
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
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeStack>(m, "DecodeStack", "A pre-norm decoder stack for decode steps, every layer in one call")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"))
      .def("add_layer", &DecodeStack::add_layer,
           "Append a layer (norms: input, post, q, k, attn_out, mlp_out; each weight: [Q4_1 tiles] or [float32 [n, K]] "
           "with no types, or GGUF parts and their type ids)",
           py::arg("norms"), py::arg("eps"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_n"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_types"), py::arg("o_n"), py::arg("gate_up"), py::arg("gate_up_types"),
           py::arg("gate_up_n"), py::arg("down"), py::arg("down_types"), py::arg("down_n"), py::arg("rope"),
           py::arg("scale"), py::arg("softcap"), py::arg("sinks"), py::arg("activation"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, "Every layer for B decode tokens; returns (x, residual)", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("k_pools"), py::arg("v_pools"), py::arg("k_scales"),
           py::arg("v_scales"), py::arg("qmax"), py::arg("slots"), py::arg("table"), py::arg("rows"),
           py::arg("plan_starts"), py::arg("plan_lens"), py::arg("plan_splits"), py::arg("prefix_rows"),
           py::arg("prefix_slots"), py::arg("prefix_starts"), py::arg("layer_plans"));
}
