// A pre-norm decoder stack for decode steps on CPUs: every layer of one step in one call.
//
// At batch 1 a decode step is mostly fixed cost: ~15 PyTorch ops a layer, each a Python call,
// a dispatch and an allocation, around matmuls that take a few microseconds each. This runs the
// same per-layer sequence from C++ (the same kernels the Python path calls, so the results are
// the same to the bit):
//
//   residual, h = add_rms_norm(x, residual)          (x itself for the first layer)
//   q, k, v     = split(h @ Wqkv.T (+ b))              (gated: [query, gate] per head, then k, v)
//   q, k        = q_norm(q), k_norm(k)                (optional: RMSNorm of each head, rows [B*H, D])
//   q, k        = rope(q), rope(k)                    (with the layer's table, over the dims it covers;
//                                                      none on a NoPE layer)
//   pool[slots] = k, v                                (converted or quantized to the pool's format)
//   p           = attention of each shared prefix's rows over it (cascade attention, as
//                 kernels/torch_decode.py's _prefix_parts computes it: flash, or soft-capped scores)
//   a, lse      = paged_decode(q over the pool, continuing p)   (each row's positions [start, start + len)
//                 of the layer's plan: its sliding window, if any; scores soft-capped if the layer says)
//   a           = a * sigmoid(lse - sinks)            (optional: attention sinks, per query head)
//   a           = a * sigmoid(gate)                   (gated layers: Qwen3-Next's output gate)
//   a           = attn_out_norm(a @ Wo.T)             (optional: Gemma's norm of the attention branch)
//   residual, h = add_rms_norm(a, residual)
//   x           = act_mul(h @ Wgate_up.T) @ Wdown.T   (act: silu, or gelu with the tanh approximation)
//   x           = mlp_out_norm(x)                     (optional: Gemma's norm of the MLP branch)
//
// A layer given routed experts (set_experts) computes its MLP line as MoEBlock.forward does: the
// router's logits, its softmax rule and top k, the chosen experts' GGUF MLPs summed with their
// weights in ascending expert id (gguf_experts_token at one row, grouped by expert at several),
// plus a shared expert scaled by the sigmoid of its gate where there is one.
//
// A hybrid model's Gated DeltaNet layer (runtime/layers/gated_delta.py) mixes tokens instead of the
// attention lines above, through the kernels its decode path calls (gated_delta.cpp):
//
//   mixed, z, b, a = split(h @ Win.T)
//   q, k, v, g, beta, conv' = gated_delta_prepare(mixed, conv state, a, b)   (the new conv state returned)
//   o, state'   = gated_delta_decode(q, k, v, g, beta, state)                (the new state in a target slot)
//   a           = gated_rms_norm(o, z) @ Wout.T
//
// The committed states are only read; the Python side stages the new ones, as that path does.
//
// Each step is the call the Python path makes (kernels/torch_decode.py, runtime/layers), with the
// same arguments in the same order, so the two agree to the bit.
//
// A linear layer's weight is Q4_1 tiles (uint8, q4_matmul.h's layout), a dense float32 matrix,
// or row parts of GGUF blocks (gguf_linear.cpp); only the fused q/k/v projection may have a bias.

#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <algorithm>
#include <optional>
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

// The attention of a full-attention layer: fused q/k/v (with a gate beside each head's query
// when gated), optional per-head q/k norms, RoPE over the first dims the table covers, attention
// over the layer's KV pool, an optional sigmoid output gate, then the output projection.
struct Attention {
  Linear qkv, o;
  Norm q_norm, k_norm;
  int64_t rope;           // index of the layer's (cos, sin) table, -1: no RoPE
  double scale, softcap;  // softcap 0: none
  c10::optional<torch::Tensor> sinks;  // float32 [H], or none
  bool gated;             // q/k/v's query rows are [query, gate] per head; output * sigmoid(gate)
  int64_t kv_layer;       // its K/V pools' index in forward's lists
};

// A Gated DeltaNet token mixer (runtime/layers/gated_delta.py): in_proj -> (mixed, z, b, a), the
// short convolution over the conv state and the gated delta rule over the recurrent state (the
// kernels GatedDeltaNet's decode path calls), the gated output norm, out_proj.
struct Delta {
  Linear in_proj, out_proj;
  torch::Tensor conv_weight, a_log, dt_bias, norm_weight;  // float32 [C, K], [H], [H], [dv]
  double norm_eps;
  int64_t key_heads, heads, head_k_dim, head_v_dim;
  int64_t state_layer;  // its conv and recurrent states' index in forward's lists
};

// One expert's gate/up and down projections as GGUF row parts and their type ids.
struct Expert {
  std::vector<torch::Tensor> gate_up, down;
  std::vector<int64_t> gate_up_types, down_types;
  int64_t gate_up_n, down_n;
};

// Routed experts in place of the dense MLP (runtime/layers/moe.py's MoEBlock): the router, the
// experts as GGUF blocks, and an optional shared expert (with an optional sigmoid gate).
struct Experts {
  torch::Tensor router_weight;                // float32 [E, hidden]
  c10::optional<torch::Tensor> router_bias;   // float32 [E]
  int64_t top_k;
  bool topk_softmax;  // GPT-OSS: softmax over the top k logits; else softmax over all, the top k kept
  bool renormalize;   // the k weights divided by their sum
  double scaling;     // routed_scaling_factor
  std::vector<Expert> experts;
  bool gelu;          // the experts' activation: gelu_tanh_mul instead of silu_mul
  std::optional<Linear> shared_gate_up, shared_down, shared_gate;
  bool shared_gelu;
};

struct Layer {
  Norm input_norm, post_norm, attn_out_norm, mlp_out_norm;
  std::optional<Attention> attention;  // exactly one of the two mixers
  std::optional<Delta> delta;
  std::optional<Linear> gate_up, down;  // the dense MLP, or (none) ...
  std::optional<Experts> experts;       // ... routed experts, set by set_experts
  bool gelu;  // gelu_tanh_mul instead of silu_mul
};

// Indices of the k largest values of each row of scores, ties to the lower index (moe_router._top).
torch::Tensor top_ids(const torch::Tensor& scores, int64_t k) {
  return std::get<1>(at::sort(scores, /*stable=*/true, -1, /*descending=*/true)).narrow(-1, 0, k);
}

// One expert's gated MLP over rows x [M, hidden] (GGUFLinear's product, then the activation).
torch::Tensor expert_mlp(const Expert& e, const torch::Tensor& x, bool gelu) {
  auto gate_up = gguf_linear(x, e.gate_up, e.gate_up_types, e.gate_up_n);
  return gguf_linear(gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up), e.down, e.down_types, e.down_n);
}

// The routed experts' weighted sum (plus the shared expert's) for x [B, hidden], as MoEBlock.forward
// computes it: route() for the softmax rules, then _one_token at one row (gguf_experts_token over
// the chosen experts in ascending id), run_experts' grouping by expert otherwise.
torch::Tensor run_moe(const Experts& m, const torch::Tensor& x) {
  const int64_t b = x.size(0), k = m.top_k, n_experts = static_cast<int64_t>(m.experts.size());
  auto logits = at::linear(x, m.router_weight, m.router_bias);
  torch::Tensor weights, ids;
  if (m.topk_softmax) {
    ids = top_ids(logits, k);
    weights = at::softmax(logits.gather(1, ids), -1) * m.scaling;
  } else {
    auto scores = at::softmax(logits, -1);
    ids = top_ids(scores, k);
    weights = scores.gather(1, ids);
    if (m.renormalize) weights = weights / (weights.sum(-1, true) + 0.0);
    if (m.scaling != 1.0) weights = weights * m.scaling;
  }
  torch::Tensor out;
  if (b == 1) {
    auto id = ids.contiguous();
    const int64_t* ip = id.data_ptr<int64_t>();
    std::vector<int64_t> order(k);
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return ip[a] < ip[c]; });
    std::vector<std::vector<torch::Tensor>> up, down;
    std::vector<std::vector<int64_t>> up_types, down_types;
    for (int64_t j : order) {
      const Expert& e = m.experts.at(ip[j]);
      up.push_back(e.gate_up);
      up_types.push_back(e.gate_up_types);
      down.push_back(e.down);
      down_types.push_back(e.down_types);
    }
    auto scale = weights[0].index_select(0, torch::tensor(order, torch::kLong));
    out = gguf_experts_token(x, up, up_types, down, down_types, scale, m.gelu);
  } else {
    auto flat = ids.reshape({-1});
    auto order = at::argsort(flat, /*stable=*/true);
    auto counts = at::bincount(flat, {}, n_experts).contiguous();
    auto rows_of = at::div(order, k, "floor");
    auto scale = weights.reshape({-1}).index_select(0, order).unsqueeze(-1);
    out = torch::zeros_like(x);
    const int64_t* cp = counts.data_ptr<int64_t>();
    int64_t start = 0;
    for (int64_t e = 0; e < n_experts; ++e) {
      const int64_t count = cp[e];
      if (count == 0) continue;
      auto rows = rows_of.narrow(0, start, count);
      out.index_add_(0, rows, expert_mlp(m.experts[e], x.index_select(0, rows), m.gelu) * scale.narrow(0, start, count));
      start += count;
    }
  }
  if (m.shared_gate_up.has_value()) {
    auto gate_up = (*m.shared_gate_up)(x);
    auto shared = (*m.shared_down)(m.shared_gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up));
    if (m.shared_gate.has_value()) shared = at::sigmoid((*m.shared_gate)(x)) * shared;
    out = out + shared;
  }
  return out;
}

}  // namespace

class DecodeStack {
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

 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  }

  // Append a full-attention layer. norms/eps: the RMSNorms' weights (float32; None where the
  // layer has none) and epsilons, in the order input, post-attention (pre-MLP), q, k,
  // attention-output, MLP-output; the first two are required. Each weight is its tensors, their
  // GGUF type ids and its output count n: one tensor and no types (uint8 Q4_1 tiles, or float32
  // [n, K]), or GGUF row parts and their types. rope: the index of the layer's (cos, sin) table in
  // forward's lists, -1 for none (a table narrower than the head rotates its first dims only);
  // scale multiplies q.k; softcap > 0 soft-caps the scores; sinks: float32 [heads] logits;
  // activation: "silu" or "gelu_tanh"; gated: q/k/v's query rows hold each head's query then its
  // gate, and the attention output is multiplied by the gate's sigmoid before o.
  void add_layer(const std::vector<c10::optional<torch::Tensor>>& norms, const std::vector<double>& eps,
                 std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_types, int64_t qkv_n,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o, std::vector<int64_t> o_types,
                 int64_t o_n, std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types, int64_t gate_up_n,
                 std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t down_n, int64_t rope,
                 double scale, double softcap, c10::optional<torch::Tensor> sinks, const std::string& activation,
                 bool gated) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv_n == (gated ? 2 : 1) * q_size + 2 * kv_size,
                "qkv must have heads * head_dim (twice that when gated) + 2 * kv_heads * head_dim outputs");
    TORCH_CHECK(norms.size() == 6 && eps.size() == 6, "six norm entries (input, post, q, k, attn_out, mlp_out) and their eps");
    TORCH_CHECK(rope >= -1, "rope must be a table index or -1");
    TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
    check_block_norms(norms);
    const int64_t hidden = norms[0]->numel();
    const int64_t sizes[6] = {hidden, hidden, head_dim_, head_dim_, hidden, hidden};
    Norm parsed[6];
    for (int i = 0; i < 6; ++i) parsed[i] = parse_norm(norms[i], eps[i], sizes[i], i);
    if (sinks.has_value()) {
      TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->numel() == heads_, "sinks must be float32 [heads]");
    }
    Layer layer{parsed[0], parsed[1], parsed[4], parsed[5], std::nullopt, std::nullopt,
                mlp_linear(std::move(gate_up), std::move(gate_up_types), gate_up_n, true),
                mlp_linear(std::move(down), std::move(down_types), down_n, false), std::nullopt, parse_activation(activation)};
    layer.attention.emplace(Attention{Linear(std::move(qkv), std::move(qkv_types), qkv_n, qkv_bias),
                                      Linear(std::move(o), std::move(o_types), o_n), parsed[2], parsed[3], rope, scale,
                                      softcap, sinks, gated, attention_layers_++});
    layers_.push_back(std::move(layer));
  }

  // Append a layer whose token mixer is a Gated DeltaNet. norms/eps: input, post-attention (pre-MLP),
  // attention-output and MLP-output RMSNorms (the last two optional). in_proj's rows are the
  // convolution's channels (q, k, v), z, b and a; conv_weight [C, K], a_log and dt_bias [heads],
  // norm_weight [head_v_dim] with norm_eps: the gated output norm; out_proj maps heads * head_v_dim
  // back. The MLP as add_layer's.
  void add_delta_layer(const std::vector<c10::optional<torch::Tensor>>& norms, const std::vector<double>& eps,
                       std::vector<torch::Tensor> in_proj, std::vector<int64_t> in_proj_types, int64_t in_proj_n,
                       torch::Tensor conv_weight, torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_weight,
                       double norm_eps, int64_t key_heads, int64_t heads, int64_t head_k_dim, int64_t head_v_dim,
                       std::vector<torch::Tensor> out_proj, std::vector<int64_t> out_proj_types, int64_t out_proj_n,
                       std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types, int64_t gate_up_n,
                       std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t down_n,
                       const std::string& activation) {
    TORCH_CHECK(norms.size() == 4 && eps.size() == 4, "four norm entries (input, post, attn_out, mlp_out) and their eps");
    TORCH_CHECK(key_heads > 0 && heads > 0 && heads % key_heads == 0 && head_k_dim > 0 && head_v_dim > 0,
                "heads must be a positive multiple of key_heads, and the head dims positive");
    const int64_t channels = 2 * key_heads * head_k_dim + heads * head_v_dim;
    TORCH_CHECK(in_proj_n == channels + heads * head_v_dim + 2 * heads,
                "in_proj must have 2 key_heads head_k_dim + 2 heads head_v_dim + 2 heads outputs (q, k, v, z, b, a)");
    auto is_float = [](const torch::Tensor& t, std::initializer_list<int64_t> shape) {
      return t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.sizes() == c10::IntArrayRef(shape);
    };
    TORCH_CHECK(conv_weight.dim() == 2 && is_float(conv_weight, {channels, conv_weight.size(1)}) && conv_weight.size(1) >= 2,
                "conv_weight must be float32 [channels, K] with K >= 2");
    TORCH_CHECK(is_float(a_log, {heads}) && is_float(dt_bias, {heads}), "a_log and dt_bias must be float32 [heads]");
    TORCH_CHECK(is_float(norm_weight, {head_v_dim}), "norm_weight must be float32 [head_v_dim]");
    check_block_norms(norms);
    const int64_t hidden = norms[0]->numel();
    Norm parsed[4];
    for (int i = 0; i < 4; ++i) parsed[i] = parse_norm(norms[i], eps[i], hidden, i);
    Layer layer{parsed[0], parsed[1], parsed[2], parsed[3], std::nullopt, std::nullopt,
                mlp_linear(std::move(gate_up), std::move(gate_up_types), gate_up_n, true),
                mlp_linear(std::move(down), std::move(down_types), down_n, false), std::nullopt, parse_activation(activation)};
    layer.delta.emplace(Delta{Linear(std::move(in_proj), std::move(in_proj_types), in_proj_n),
                              Linear(std::move(out_proj), std::move(out_proj_types), out_proj_n), conv_weight.contiguous(),
                              a_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(), norm_eps, key_heads, heads,
                              head_k_dim, head_v_dim, delta_layers_++});
    layers_.push_back(std::move(layer));
  }

  // Give the last layer added (one added without MLP weights) routed experts. router_weight
  // float32 [E, hidden] (router_bias [E] or None); scoring "softmax" (probabilities over all
  // experts, the top k kept, divided by their sum when renormalize) or "topk_softmax" (softmax
  // over the top k logits); the k weights times scaling. Expert e's gate/up and down: GGUF row
  // parts and type ids (gate_up[e], gate_up_types[e], down[e], down_types[e]); activation: the
  // experts'. shared_*: an optional shared expert (no tensors: none) computed with
  // shared_activation, scaled by sigmoid(shared_gate(x)) where shared_gate has tensors.
  void set_experts(torch::Tensor router_weight, c10::optional<torch::Tensor> router_bias, int64_t top_k,
                   const std::string& scoring, bool renormalize, double scaling,
                   std::vector<std::vector<torch::Tensor>> gate_up, std::vector<std::vector<int64_t>> gate_up_types,
                   std::vector<std::vector<torch::Tensor>> down, std::vector<std::vector<int64_t>> down_types,
                   const std::string& activation, std::vector<torch::Tensor> shared_gate_up,
                   std::vector<int64_t> shared_gate_up_types, int64_t shared_gate_up_n,
                   std::vector<torch::Tensor> shared_down, std::vector<int64_t> shared_down_types, int64_t shared_down_n,
                   std::vector<torch::Tensor> shared_gate, std::vector<int64_t> shared_gate_types,
                   const std::string& shared_activation) {
    TORCH_CHECK(!layers_.empty(), "set_experts needs a layer added first");
    Layer& layer = layers_.back();
    TORCH_CHECK(!layer.gate_up.has_value() && !layer.experts.has_value(), "the last layer already has an MLP or experts");
    TORCH_CHECK(scoring == "softmax" || scoring == "topk_softmax", "scoring must be softmax or topk_softmax, got ", scoring);
    const int64_t n_experts = static_cast<int64_t>(gate_up.size()), hidden = layer.input_norm.weight.numel();
    TORCH_CHECK(n_experts > 0 && gate_up_types.size() == gate_up.size() && down.size() == gate_up.size() &&
                    down_types.size() == gate_up.size(),
                "gate_up, gate_up_types, down and down_types need one entry per expert");
    TORCH_CHECK(top_k > 0 && top_k <= n_experts, "top_k must be in 1..", n_experts);
    TORCH_CHECK(router_weight.scalar_type() == torch::kFloat && router_weight.dim() == 2 &&
                    router_weight.size(0) == n_experts && router_weight.size(1) == hidden,
                "router_weight must be float32 [experts, hidden]");
    if (router_bias.has_value()) {
      TORCH_CHECK(router_bias->scalar_type() == torch::kFloat && router_bias->numel() == n_experts, "router_bias must be float32 [experts]");
    }
    Experts m{router_weight, router_bias, top_k, scoring == "topk_softmax", renormalize, scaling, {}, parse_activation(activation),
              std::nullopt, std::nullopt, std::nullopt, parse_activation(shared_activation)};
    int64_t inter2 = -1;
    for (int64_t e = 0; e < n_experts; ++e) {
      TORCH_CHECK(gate_up[e].size() == gate_up_types[e].size() && down[e].size() == down_types[e].size() && !gate_up[e].empty() &&
                      !down[e].empty(),
                  "expert ", e, ": one type per GGUF part");
      Expert ex{gate_up[e], down[e], gate_up_types[e], down_types[e], 0, 0};
      for (const auto& p : ex.gate_up) ex.gate_up_n += p.size(0);
      for (const auto& p : ex.down) ex.down_n += p.size(0);
      TORCH_CHECK(ex.gate_up_n % 2 == 0 && (inter2 < 0 || ex.gate_up_n == inter2) && ex.down_n == hidden,
                  "expert ", e, ": gate/up must have the other experts' even row count and down hidden rows");
      inter2 = ex.gate_up_n;
      m.experts.push_back(std::move(ex));
    }
    m.shared_gate_up = optional_linear(std::move(shared_gate_up), std::move(shared_gate_up_types), shared_gate_up_n);
    m.shared_down = optional_linear(std::move(shared_down), std::move(shared_down_types), shared_down_n);
    m.shared_gate = optional_linear(std::move(shared_gate), std::move(shared_gate_types), 1);
    TORCH_CHECK(m.shared_gate_up.has_value() == m.shared_down.has_value(), "a shared expert needs gate/up and down");
    TORCH_CHECK(m.shared_gate_up.has_value() || !m.shared_gate.has_value(), "a shared gate needs a shared expert");
    layer.experts.emplace(std::move(m));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] float32 (the embeddings of B decode tokens); cos/sin: the RoPE tables, each
  // [B, R/2] float32 (R <= head_dim: the dims rotated), that layers name by index; k_pools/v_pools:
  // one [N, Hkv, D] tensor an attention layer (any dtype paged_decode reads), k_scales / v_scales:
  // their fp16 [N, Hkv] scales for 8-bit pools (qmax: the format's largest code); slots [B]: where
  // the new KV goes; table/rows as for paged_decode. The plans (one entry each in the plan_*
  // lists): plan_starts/plan_lens [B] each row's positions to attend after its shared prefixes
  // (the new token included), plan_splits the chunks a row is cut into, prefix_rows /
  // prefix_slots / prefix_starts the shared prefixes (the rows of each, its slots, its first slot
  // when they are contiguous, else -1; they need a pool in x's dtype). layer_plans: the plan of
  // each attention layer. Gated DeltaNet layers, one entry each: conv_pools [N, C, K - 1] float32
  // and state_pools [S, H, dk, dv] to read at conv_rows / state_rows [B] (-1: zeros), the new
  // recurrent states written into state_targets at state_out_rows [B] (or row b at b without
  // them), as gated_delta_prepare and gated_delta_decode take them. Returns (x, residual) after the
  // last layer, then each Gated DeltaNet layer's new conv states [B, C, K - 1].
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
                                     const std::vector<int64_t>& layer_plans,
                                     const std::vector<torch::Tensor>& conv_pools,
                                     const std::vector<torch::Tensor>& state_pools,
                                     c10::optional<torch::Tensor> conv_rows, c10::optional<torch::Tensor> state_rows,
                                     const std::vector<torch::Tensor>& state_targets,
                                     c10::optional<torch::Tensor> state_out_rows) const {
    const int64_t n_layers = num_layers();
    TORCH_CHECK(n_layers > 0, "the decode stack has no layers");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [B, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == attention_layers_ &&
                    static_cast<int64_t>(v_pools.size()) == attention_layers_ &&
                    static_cast<int64_t>(k_scales.size()) == attention_layers_ &&
                    static_cast<int64_t>(v_scales.size()) == attention_layers_,
                "one K and V pool (and scale entry) per attention layer");
    TORCH_CHECK(static_cast<int64_t>(layer_plans.size()) == attention_layers_, "one plan index per attention layer");
    TORCH_CHECK(static_cast<int64_t>(conv_pools.size()) == delta_layers_ &&
                    static_cast<int64_t>(state_pools.size()) == delta_layers_ &&
                    static_cast<int64_t>(state_targets.size()) == delta_layers_,
                "one conv pool, state pool and state target per Gated DeltaNet layer");
    TORCH_CHECK(delta_layers_ == 0 || (conv_rows.has_value() && state_rows.has_value()),
                "Gated DeltaNet layers need conv_rows and state_rows");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    const int64_t b = x.size(0);
    TORCH_CHECK(slots.numel() == b && rows.numel() == b, "one slot and table row per token");
    const std::vector<Plan> plans = make_plans(b, plan_starts, plan_lens, plan_splits, prefix_rows, prefix_slots, prefix_starts);
    auto slot_index = slots.to(torch::kLong).contiguous();
    torch::Tensor residual;
    std::vector<torch::Tensor> out{torch::Tensor(), torch::Tensor()};
    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& layer = layers_[i];
      auto normed = add_rms_norm(x, residual.defined() ? c10::optional<torch::Tensor>(residual) : c10::nullopt,
                                 layer.input_norm.weight, layer.input_norm.eps);
      residual = normed[0];
      torch::Tensor a;
      if (layer.attention.has_value()) {
        const Attention& attn = *layer.attention;
        TORCH_CHECK(attn.rope < static_cast<int64_t>(cos.size()), "layer ", i, " uses RoPE table ", attn.rope, " of ", cos.size());
        TORCH_CHECK(layer_plans[attn.kv_layer] >= 0 && layer_plans[attn.kv_layer] < static_cast<int64_t>(plans.size()),
                    "layer ", i, " has no plan");
        a = attend_layer(attn, normed[1], cos, sin, k_pools, v_pools, k_scales, v_scales, qmax, slot_index, table, rows,
                         plans[layer_plans[attn.kv_layer]]);
      } else {
        const Delta& d = *layer.delta;
        const int64_t s = d.state_layer;
        a = delta_layer(d, normed[1], conv_pools[s], *conv_rows, state_pools[s], *state_rows, state_targets[s],
                        state_out_rows, out);
      }
      if (layer.attn_out_norm.defined()) a = layer.attn_out_norm(a);
      normed = add_rms_norm(a, residual, layer.post_norm.weight, layer.post_norm.eps);
      residual = normed[0];
      if (layer.experts.has_value()) {
        x = run_moe(*layer.experts, normed[1]);
      } else {
        TORCH_CHECK(layer.gate_up.has_value() && layer.down.has_value(), "layer ", i, " has neither an MLP nor experts");
        auto gate_up = (*layer.gate_up)(normed[1]);
        x = (*layer.down)(layer.gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up));
      }
      if (layer.mlp_out_norm.defined()) x = layer.mlp_out_norm(x);
    }
    out[0] = x;
    out[1] = residual;
    return out;
  }

 private:
  // The attention branch of one layer for the normalized input h [B, hidden]: [B, hidden] before
  // the attention-output norm.
  torch::Tensor attend_layer(const Attention& attn, const torch::Tensor& h, const std::vector<torch::Tensor>& cos,
                             const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& k_pools,
                             const std::vector<torch::Tensor>& v_pools,
                             const std::vector<c10::optional<torch::Tensor>>& k_scales,
                             const std::vector<c10::optional<torch::Tensor>>& v_scales, double qmax,
                             const torch::Tensor& slot_index, const torch::Tensor& table, const torch::Tensor& rows,
                             const Plan& plan) const {
    const int64_t b = h.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t q_rows = attn.gated ? 2 * q_size : q_size;
    const int64_t p = attn.kv_layer;
    auto qkv = attn.qkv(h);
    torch::Tensor q, gate;
    if (attn.gated) {  // each head's query, then its gate (as DenseAttention splits them)
      auto qg = qkv.narrow(1, 0, q_rows).view({b, heads_, 2 * head_dim_});
      q = qg.narrow(2, 0, head_dim_);
      gate = qg.narrow(2, head_dim_, head_dim_).reshape({b, q_size});
    } else {
      q = qkv.narrow(1, 0, q_size).view({b, heads_, head_dim_});
    }
    q = head_norm(q, attn.q_norm);
    auto k = head_norm(qkv.narrow(1, q_rows, kv_size).view({b, kv_heads_, head_dim_}), attn.k_norm);
    auto v = qkv.narrow(1, q_rows + kv_size, kv_size).view({b, kv_heads_, head_dim_});
    if (attn.rope >= 0) {
      q = rotate(q, cos[attn.rope], sin[attn.rope]);
      k = rotate(k, cos[attn.rope], sin[attn.rope]);
    }
    store(k, k_pools[p], k_scales[p], slot_index, qmax);
    store(v, v_pools[p], v_scales[p], slot_index, qmax);
    c10::optional<torch::Tensor> init_out, init_lse;
    prefix_parts(q, k_pools[p], v_pools[p], plan.prefixes, attn.scale, attn.softcap, init_out, init_lse);
    auto parts = paged_decode(q, k_pools[p], v_pools[p], table, rows, plan.starts, plan.lens, attn.scale, init_out,
                              init_lse, k_scales[p], v_scales[p], plan.splits, attn.softcap);
    auto a = parts[0];
    if (attn.sinks.has_value()) a = a * at::sigmoid(parts[1] - *attn.sinks).unsqueeze(-1);
    a = a.view({b, q_size});
    if (attn.gated) a = a * at::sigmoid(gate);
    return attn.o(a);
  }

  // The Gated DeltaNet branch of one layer for the normalized input h [B, hidden], as
  // GatedDeltaNet's decode path computes it; appends the new conv states to `out`.
  static torch::Tensor delta_layer(const Delta& d, const torch::Tensor& h, const torch::Tensor& conv_pool,
                                   const torch::Tensor& conv_rows, const torch::Tensor& state_pool,
                                   const torch::Tensor& state_rows, const torch::Tensor& state_target,
                                   const c10::optional<torch::Tensor>& state_out_rows, std::vector<torch::Tensor>& out) {
    const int64_t b = h.size(0), value_dim = d.heads * d.head_v_dim;
    const int64_t channels = 2 * d.key_heads * d.head_k_dim + value_dim;
    auto proj = d.in_proj(h);
    auto mixed = proj.narrow(1, 0, channels);
    auto z = proj.narrow(1, channels, value_dim);
    auto beta_in = proj.narrow(1, channels + value_dim, d.heads);
    auto a_in = proj.narrow(1, channels + value_dim + d.heads, d.heads);
    auto prep = gated_delta_prepare(mixed, conv_pool, conv_rows, d.conv_weight, a_in, beta_in, d.a_log, d.dt_bias,
                                    d.key_heads, d.head_k_dim, d.head_v_dim, 1e-6);
    auto step = gated_delta_decode(prep[0], prep[1], prep[2], prep[3], prep[4], state_pool, state_rows, state_target,
                                   state_out_rows);
    out.push_back(prep[5]);
    return d.out_proj(gated_rms_norm(step[0], z, d.norm_weight, d.norm_eps).view({b, value_dim}));
  }

  // x [B, heads, D] rotated with cos/sin [B, R/2]: the whole head (R == D), or its first R dims
  // with the rest passed through (as apply_rotary's partial form computes it).
  torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) const {
    const int64_t rotary = 2 * cos.size(1);
    TORCH_CHECK(rotary > 0 && rotary <= head_dim_, "a RoPE table covers ", rotary, " dims of ", head_dim_);
    if (rotary == head_dim_) return ::rope(x, cos, sin);
    return at::cat({::rope(x.narrow(2, 0, rotary), cos, sin), x.narrow(2, rotary, head_dim_ - rotary)}, 2);
  }

  static void check_block_norms(const std::vector<c10::optional<torch::Tensor>>& norms) {
    TORCH_CHECK(norms[0].has_value() && norms[1].has_value(), "the input and post-attention norms are required");
  }

  // An RMSNorm entry (index i of add_layer's or add_delta_layer's list) checked to be float32 [n].
  static Norm parse_norm(const c10::optional<torch::Tensor>& weight, double eps, int64_t n, int i) {
    if (!weight.has_value()) return Norm{};
    TORCH_CHECK(weight->scalar_type() == torch::kFloat && weight->numel() == n, "norm ", i, " must be float32 [", n, "]");
    return Norm{*weight, eps};
  }

  // A dense MLP projection, or none (no tensors: the layer's routed experts come by set_experts).
  static std::optional<Linear> mlp_linear(std::vector<torch::Tensor> w, std::vector<int64_t> types, int64_t n, bool gate_up) {
    TORCH_CHECK(w.empty() || !gate_up || n % 2 == 0, "gate_up must have an even number of outputs");
    return optional_linear(std::move(w), std::move(types), n);
  }

  // A linear layer, or none where it has no tensors.
  static std::optional<Linear> optional_linear(std::vector<torch::Tensor> w, std::vector<int64_t> types, int64_t n) {
    if (w.empty()) return std::nullopt;
    return Linear(std::move(w), std::move(types), n);
  }

  static bool parse_activation(const std::string& activation) {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ", activation);
    return activation == "gelu_tanh";
  }
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
  int64_t attention_layers_ = 0, delta_layers_ = 0;  // layers of each kind so far (their pools' indices)
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeStack>(m, "DecodeStack", "A pre-norm decoder stack for decode steps, every layer in one call")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"))
      .def("add_layer", &DecodeStack::add_layer,
           "Append a full-attention layer (norms: input, post, q, k, attn_out, mlp_out; each weight: [Q4_1 tiles] or "
           "[float32 [n, K]] with no types, or GGUF parts and their type ids)",
           py::arg("norms"), py::arg("eps"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_n"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_types"), py::arg("o_n"), py::arg("gate_up"), py::arg("gate_up_types"),
           py::arg("gate_up_n"), py::arg("down"), py::arg("down_types"), py::arg("down_n"), py::arg("rope"),
           py::arg("scale"), py::arg("softcap"), py::arg("sinks"), py::arg("activation"), py::arg("gated") = false)
      .def("add_delta_layer", &DecodeStack::add_delta_layer,
           "Append a layer whose token mixer is a Gated DeltaNet (norms: input, post, attn_out, mlp_out)", py::arg("norms"),
           py::arg("eps"), py::arg("in_proj"), py::arg("in_proj_types"), py::arg("in_proj_n"), py::arg("conv_weight"),
           py::arg("a_log"), py::arg("dt_bias"), py::arg("norm_weight"), py::arg("norm_eps"), py::arg("key_heads"),
           py::arg("heads"), py::arg("head_k_dim"), py::arg("head_v_dim"), py::arg("out_proj"), py::arg("out_proj_types"),
           py::arg("out_proj_n"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("gate_up_n"), py::arg("down"),
           py::arg("down_types"), py::arg("down_n"), py::arg("activation"))
      .def("set_experts", &DecodeStack::set_experts,
           "Give the last layer added (without MLP weights) routed experts: the router, each expert's GGUF gate/up and "
           "down, an optional shared expert and its gate",
           py::arg("router_weight"), py::arg("router_bias"), py::arg("top_k"), py::arg("scoring"), py::arg("renormalize"),
           py::arg("scaling"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"),
           py::arg("activation"), py::arg("shared_gate_up"), py::arg("shared_gate_up_types"), py::arg("shared_gate_up_n"),
           py::arg("shared_down"), py::arg("shared_down_types"), py::arg("shared_down_n"), py::arg("shared_gate"),
           py::arg("shared_gate_types"), py::arg("shared_activation"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward,
           "Every layer for B decode tokens; returns (x, residual, then each Gated DeltaNet layer's new conv states)",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_pools"), py::arg("v_pools"), py::arg("k_scales"),
           py::arg("v_scales"), py::arg("qmax"), py::arg("slots"), py::arg("table"), py::arg("rows"),
           py::arg("plan_starts"), py::arg("plan_lens"), py::arg("plan_splits"), py::arg("prefix_rows"),
           py::arg("prefix_slots"), py::arg("prefix_starts"), py::arg("layer_plans"),
           py::arg("conv_pools") = std::vector<torch::Tensor>{}, py::arg("state_pools") = std::vector<torch::Tensor>{},
           py::arg("conv_rows") = py::none(), py::arg("state_rows") = py::none(),
           py::arg("state_targets") = std::vector<torch::Tensor>{}, py::arg("state_out_rows") = py::none());
}
