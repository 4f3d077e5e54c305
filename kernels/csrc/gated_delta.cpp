// The decode step of the gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5) for CPUs: one
// token per request, every request and value head at once, as delta_rule_recurrent in
// runtime/layers/gated_delta.py computes it for one token:
//
//   S <- S * exp(g);  m = S^T k;  d = (v - m) * beta;  S <- S + k d^T;  o = S^T q
//
// with S a [dk, dv] fp32 matrix per (request, value head). Each state is read once and the new
// one written once, in tiles of TILE value columns: a tile's columns of S ([dk, TILE], 16 KiB at
// dk = 128) are read for m (TILE accumulators), then, still in L1, decayed, updated and written
// to the output, q's dot with the new columns summed as they are written. The new state goes to
// an output tensor, not over the input: a request's committed state stays as it was until the
// scheduler commits the new one. The state may be read in place from a pool through a row index
// (a negative index: the request starts from zeros).
//
// Grid: one task per (request, value head), spread over the intra-op threads. The loops are plain
// `omp simd` loops over a tile's columns, vectorized for whatever -march the build targets
// (AVX-512 or AVX2); dv not a multiple of TILE ends with a narrower tile.

#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t TILE = 32;  // value columns per tile: 2 AVX-512 or 4 AVX2 registers per accumulator

// The strides (in floats) of one operand.
struct Strides {
  int64_t b, h;
};

// Columns [0, width) of one state tile (width == TILE when FULL, so the loops have a constant
// trip count): src and dst point at the tile's first column of row 0, rows src_row and dst_row
// floats apart; src is null for a zero state. Writes the tile's new columns and o's.
template <bool FULL>
inline void delta_tile(const float* src, int64_t src_row, float* dst, int64_t dst_row, const float* q, const float* k,
                       const float* v, float decay, float beta, float* o, int64_t dk, int64_t width) {
  const int64_t n = FULL ? TILE : width;
  // m = S^T k over two accumulators (even and odd rows: two chains of adds per column in flight)
  float m0[TILE] = {}, m1[TILE] = {};
  if (src != nullptr) {
    int64_t i = 0;
    for (; i + 2 <= dk; i += 2) {
      const float* r0 = src + i * src_row;
      const float* r1 = r0 + src_row;
      const float k0 = k[i], k1 = k[i + 1];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        m0[j] += k0 * r0[j];
        m1[j] += k1 * r1[j];
      }
    }
    if (i < dk) {
      const float* r0 = src + i * src_row;
      const float k0 = k[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) m0[j] += k0 * r0[j];
    }
  }
  float d[TILE];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] = (v[j] - decay * (m0[j] + m1[j])) * beta;
  // S' = decay * S + k d^T, written row by row; o = S'^T q as the rows go
  float o0[TILE] = {}, o1[TILE] = {};
  if (src != nullptr) {
    int64_t i = 0;
    for (; i + 2 <= dk; i += 2) {
      const float* r0 = src + i * src_row;
      const float* r1 = r0 + src_row;
      float* w0 = dst + i * dst_row;
      float* w1 = w0 + dst_row;
      const float k0 = k[i], k1 = k[i + 1], q0 = q[i], q1 = q[i + 1];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float s0 = decay * r0[j] + k0 * d[j];
        const float s1 = decay * r1[j] + k1 * d[j];
        w0[j] = s0;
        w1[j] = s1;
        o0[j] += q0 * s0;
        o1[j] += q1 * s1;
      }
    }
    if (i < dk) {
      const float* r0 = src + i * src_row;
      float* w0 = dst + i * dst_row;
      const float k0 = k[i], q0 = q[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float s0 = decay * r0[j] + k0 * d[j];
        w0[j] = s0;
        o0[j] += q0 * s0;
      }
    }
  } else {  // S' = k d^T
    for (int64_t i = 0; i < dk; ++i) {
      float* w0 = dst + i * dst_row;
      const float k0 = k[i], q0 = q[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float s0 = k0 * d[j];
        w0[j] = s0;
        o0[j] += q0 * s0;
      }
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = o0[j] + o1[j];
}

void check_float(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions");
}

}  // namespace

// One decode step of the gated delta rule for B requests and H value heads: q, k [B, Hk, dk]
// (normalised, q scaled; value head h reads key head h / (H / Hk)), v [B, H, dv], g (log decay)
// and beta [B, H], the states [N, H, dk, dv] (N == B without rows; with rows [B] int64, request b
// reads state rows[b], or zeros where rows[b] < 0). Every tensor is float32 on the CPU; the last
// dimension of q, k, v and the states must be contiguous, the others may be strided. The new
// states go to out_state [B, H, dk, dv] (allocated when not given; it may be state itself, an
// update in place, when rows is not given: the same view of the same memory); with out_rows [B]
// int64, request b's new state goes to row out_rows[b] of out_state [N2, H, dk, dv] instead (which
// may be state itself where no out row is a row read). Returns (o [B, H, dv], out_state).
std::vector<torch::Tensor> gated_delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                              torch::Tensor beta, torch::Tensor state, c10::optional<torch::Tensor> rows,
                                              c10::optional<torch::Tensor> out_state,
                                              c10::optional<torch::Tensor> out_rows) {
  check_float(q, "q", 3);
  check_float(k, "k", 3);
  check_float(v, "v", 3);
  check_float(g, "g", 2);
  check_float(beta, "beta", 2);
  check_float(state, "state", 4);
  const int64_t B = v.size(0), H = v.size(1), dv = v.size(2), Hk = q.size(1), dk = q.size(2);
  TORCH_CHECK(q.size(0) == B && k.sizes() == q.sizes() && Hk > 0 && H % Hk == 0,
              "q and k must be [B, Hk, dk] with Hk dividing v's heads");
  TORCH_CHECK(g.size(0) == B && g.size(1) == H && beta.sizes() == g.sizes(), "g and beta must be [B, H]");
  TORCH_CHECK(state.size(1) == H && state.size(2) == dk && state.size(3) == dv, "state must be [N, H, dk, dv]");
  auto ensure_unit = [](torch::Tensor t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  q = ensure_unit(q);
  k = ensure_unit(k);
  v = ensure_unit(v);
  state = ensure_unit(state);
  std::vector<int64_t> index;
  if (rows.has_value()) {
    auto r = rows->to(torch::kLong).cpu().contiguous();
    TORCH_CHECK(r.dim() == 1 && r.size(0) == B, "rows must be [B]");
    index.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + B);
    for (int64_t x : index) TORCH_CHECK(x < state.size(0), "a row index is past the state's ", state.size(0), " rows");
  } else {
    TORCH_CHECK(state.size(0) == B, "state must be [B, H, dk, dv] without rows");
  }
  torch::Tensor out;
  std::vector<int64_t> out_index;
  if (out_rows.has_value()) {
    TORCH_CHECK(out_state.has_value(), "out_rows needs out_state");
    out = *out_state;
    check_float(out, "out_state", 4);
    TORCH_CHECK(out.size(1) == H && out.size(2) == dk && out.size(3) == dv && out.stride(3) == 1,
                "out_state must be [N, H, dk, dv] with a contiguous last dimension");
    auto r = out_rows->to(torch::kLong).cpu().contiguous();
    TORCH_CHECK(r.dim() == 1 && r.size(0) == B, "out_rows must be [B]");
    out_index.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + B);
    std::vector<int64_t> sorted_out(out_index);
    std::sort(sorted_out.begin(), sorted_out.end());
    for (size_t i = 0; i < sorted_out.size(); ++i) {
      TORCH_CHECK(sorted_out[i] >= 0 && sorted_out[i] < out.size(0), "an out row is outside out_state's ", out.size(0), " rows");
      TORCH_CHECK(i == 0 || sorted_out[i] != sorted_out[i - 1], "two requests write out row ", sorted_out[i]);
    }
    if (out.data_ptr() == state.data_ptr()) {  // the same rows: no request may write a row another reads
      TORCH_CHECK(rows.has_value() && out.strides() == state.strides(), "out_rows into state itself needs rows and the same layout");
      for (int64_t x : index)
        TORCH_CHECK(!std::binary_search(sorted_out.begin(), sorted_out.end(), x), "row ", x, " is both read and written");
    } else {
      at::assert_no_overlap(out, state);
    }
  } else if (out_state.has_value()) {
    out = *out_state;
    check_float(out, "out_state", 4);
    TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == dk && out.size(3) == dv && out.stride(3) == 1,
                "out_state must be [B, H, dk, dv] with a contiguous last dimension");
    const bool same = out.data_ptr() == state.data_ptr() && out.strides() == state.strides();  // in place: each value read before written
    if (rows.has_value() || !same) at::assert_no_overlap(out, state);
  } else {
    out = torch::empty({B, H, dk, dv}, state.options());
  }
  auto o = torch::empty({B, H, dv}, v.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const float* sp = state.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const Strides qs{q.stride(0), q.stride(1)}, ks{k.stride(0), k.stride(1)}, vs{v.stride(0), v.stride(1)};
  const Strides gs{g.stride(0), g.stride(1)}, bs{beta.stride(0), beta.stride(1)};
  const Strides ss{state.stride(0), state.stride(1)}, os{out.stride(0), out.stride(1)};
  const int64_t s_row = state.stride(2), o_row = out.stride(2), group = H / Hk;
  const int64_t* idx = rows.has_value() ? index.data() : nullptr;
  const int64_t* out_idx = out_rows.has_value() ? out_index.data() : nullptr;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H, hk = h / group;
      const int64_t r = idx == nullptr ? b : idx[b];
      const float* src = r < 0 ? nullptr : sp + r * ss.b + h * ss.h;
      float* dst = outp + (out_idx == nullptr ? b : out_idx[b]) * os.b + h * os.h;
      const float* qh = qp + b * qs.b + hk * qs.h;
      const float* kh = kp + b * ks.b + hk * ks.h;
      const float* vh = vp + b * vs.b + h * vs.h;
      const float decay = std::exp(gp[b * gs.b + h * gs.h]);
      const float bt = bp[b * bs.b + h * bs.h];
      float* oh = op + (b * H + h) * dv;
      int64_t j0 = 0;
      for (; j0 + TILE <= dv; j0 += TILE)
        delta_tile<true>(src == nullptr ? nullptr : src + j0, s_row, dst + j0, o_row, qh, kh, vh + j0, decay, bt,
                         oh + j0, dk, TILE);
      if (j0 < dv)
        delta_tile<false>(src == nullptr ? nullptr : src + j0, s_row, dst + j0, o_row, qh, kh, vh + j0, decay, bt,
                          oh + j0, dk, dv - j0);
    }
  });
  return {o, out};
}

// The decode step's inputs from the in_proj output of B requests, one token each, all float32:
// the short causal convolution of each channel over its last K inputs (the conv state read at
// rows[b] of conv_state [N, C, K - 1], zeros where rows[b] < 0, then this token's mixed [B, C]),
// SiLU; q and k L2-normalised over each of key_heads heads (q then scaled by head_k_dim^-1/2), v;
// per value head the log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)
// (a, b [B, H]); and each request's new conv state, its last K - 1 inputs. As GatedDeltaNet's
// PyTorch path computes them. Returns (q [B, Hk, dk], k [B, Hk, dk], v [B, H, dv], g [B, H],
// beta [B, H], conv_out [B, C, K - 1]).
std::vector<torch::Tensor> gated_delta_prepare(torch::Tensor mixed, torch::Tensor conv_state, torch::Tensor rows,
                                               torch::Tensor weight, torch::Tensor a, torch::Tensor b,
                                               torch::Tensor a_log, torch::Tensor dt_bias, int64_t key_heads,
                                               int64_t head_k_dim, int64_t head_v_dim, double eps) {
  check_float(mixed, "mixed", 2);
  check_float(conv_state, "conv_state", 3);
  check_float(weight, "weight", 2);
  check_float(a, "a", 2);
  check_float(b, "b", 2);
  check_float(a_log, "A_log", 1);
  check_float(dt_bias, "dt_bias", 1);
  const int64_t B = mixed.size(0), C = mixed.size(1), K = weight.size(1), H = a.size(1);
  const int64_t key_dim = key_heads * head_k_dim;
  TORCH_CHECK(C == 2 * key_dim + H * head_v_dim, "mixed must be [B, 2 Hk dk + H dv]");
  TORCH_CHECK(weight.size(0) == C && K >= 2 && conv_state.size(1) == C && conv_state.size(2) == K - 1,
              "weight must be [C, K] and conv_state [N, C, K - 1]");
  TORCH_CHECK(a.size(0) == B && b.sizes() == a.sizes() && a_log.size(0) == H && dt_bias.size(0) == H && H % key_heads == 0,
              "a and b must be [B, H], A_log and dt_bias [H]");
  TORCH_CHECK(mixed.stride(1) == 1 && a.stride(1) == 1 && b.stride(1) == 1, "mixed, a and b need contiguous rows");
  auto r = rows.to(torch::kLong).cpu().contiguous();
  TORCH_CHECK(r.dim() == 1 && r.size(0) == B, "rows must be [B]");
  const int64_t* idx = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) TORCH_CHECK(idx[i] < conv_state.size(0), "a row index is past conv_state's rows");
  auto cs = conv_state.contiguous();
  auto w = weight.contiguous();
  auto al = a_log.contiguous();
  auto db = dt_bias.contiguous();
  auto opts = mixed.options();
  auto q = torch::empty({B, key_heads, head_k_dim}, opts);
  auto k = torch::empty({B, key_heads, head_k_dim}, opts);
  auto v = torch::empty({B, H, head_v_dim}, opts);
  auto g = torch::empty({B, H}, opts);
  auto beta = torch::empty({B, H}, opts);
  auto tail = torch::empty({B, C, K - 1}, opts);
  const float* mp = mixed.data_ptr<float>();
  const float* sp = cs.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *tp = tail.data_ptr<float>();
  const int64_t m_row = mixed.stride(0);
  // the convolution, SiLU, and the new conv states: every (request, channel)
  at::parallel_for(0, B * C, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / C, c = t % C;
      const float* prev = idx[i] < 0 ? nullptr : sp + (idx[i] * C + c) * (K - 1);
      const float* wc = wp + c * K;
      float* out_tail = tp + t * (K - 1);
      const float x = mp[i * m_row + c];
      float acc = 0.0f;
      for (int64_t j = 0; j < K - 1; ++j) {
        const float in = prev == nullptr ? 0.0f : prev[j];
        acc += in * wc[j];
        if (j > 0) out_tail[j - 1] = in;
      }
      acc += x * wc[K - 1];
      out_tail[K - 2] = x;
      const float y = acc / (1.0f + std::exp(-acc));  // SiLU
      if (c < key_dim) qp[i * key_dim + c] = y;
      else if (c < 2 * key_dim) kp[i * key_dim + c - key_dim] = y;
      else vp[i * H * head_v_dim + c - 2 * key_dim] = y;
    }
  });
  // q and k normalised per head; g and beta per value head
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_k_dim));
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  const float* alp = al.data_ptr<float>();
  const float* dbp = db.data_ptr<float>();
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t h = 0; h < 2 * key_heads; ++h) {
      float* x = (h < key_heads ? qp + (i * key_heads + h) * head_k_dim : kp + (i * key_heads + h - key_heads) * head_k_dim);
      float ss = 0.0f;
      for (int64_t d = 0; d < head_k_dim; ++d) ss += x[d] * x[d];
      const float inv = 1.0f / std::sqrt(ss + static_cast<float>(eps)) * (h < key_heads ? scale : 1.0f);
      for (int64_t d = 0; d < head_k_dim; ++d) x[d] *= inv;
    }
    for (int64_t h = 0; h < H; ++h) {
      const float z = ap[i * a.stride(0) + h] + dbp[h];
      const float softplus = z > 20.0f ? z : std::log1p(std::exp(z));
      gp[i * H + h] = -std::exp(alp[h]) * softplus;
      betap[i * H + h] = 1.0f / (1.0f + std::exp(-bp[i * b.stride(0) + h]));
    }
  }
  return {q, k, v, g, beta, tail};
}

// weight * rmsnorm(o) * silu(z) over each of o's [B, H, dv] heads (float32; z [B, H * dv] with
// contiguous rows): the Gated DeltaNet's output norm. Returns [B, H * dv].
torch::Tensor gated_rms_norm(torch::Tensor o, torch::Tensor z, torch::Tensor weight, double eps) {
  check_float(o, "o", 3);
  check_float(z, "z", 2);
  check_float(weight, "weight", 1);
  const int64_t B = o.size(0), H = o.size(1), dv = o.size(2);
  TORCH_CHECK(z.size(0) == B && z.size(1) == H * dv && z.stride(1) == 1 && weight.size(0) == dv,
              "z must be [B, H * dv] with contiguous rows and weight [dv]");
  auto oc = o.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty({B, H * dv}, o.options());
  const float* op = oc.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int64_t z_row = z.stride(0);
  at::parallel_for(0, B * H, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / H, h = t % H;
      const float* x = op + t * dv;
      const float* zh = zp + i * z_row + h * dv;
      float* y = outp + t * dv;
      float ss = 0.0f;
      for (int64_t d = 0; d < dv; ++d) ss += x[d] * x[d];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
      for (int64_t d = 0; d < dv; ++d) {
        const float gate = zh[d] / (1.0f + std::exp(-zh[d]));
        y[d] = wp[d] * (x[d] * inv) * gate;
      }
    }
  });
  return out;
}
