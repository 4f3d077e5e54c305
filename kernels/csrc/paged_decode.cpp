// Paged decode attention for CPUs: each query row attends to a range of its slot-table row,
// reading keys and values straight from the KV pool (no gather into a temporary copy).
//
// Grid: one task per (row, chunk, KV-head group), spread over the intra-op threads. A row's range
// is cut into `splits` chunks (whole blocks) so that a small batch still keeps every thread busy;
// where rows and chunks are still fewer than the threads (batch 1 at a short context, which the
// caller leaves whole), the KV heads are cut into groups too. A task loads its query heads, walks
// its chunk's slots in blocks of BLOCK keys and, for each of its KV heads in turn, computes the
// block's scores (one dot product per key and query head), rescales
// its online softmax once and adds the block's values (16 output lanes at a time, kept in
// registers); it writes the normalized output and log-sum-exp of the chunk, and the chunks are
// then merged by their lse. The
// result's lse lets the caller merge with a shared-prefix part too (cascade attention).
//
// The pool may hold fp32, bf16, fp16, int8 or fp8 (e4m3fn / e5m2) values; 8-bit pools come with
// one fp16 scale per (slot, KV head) for K and for V. Values are converted to fp32 as they are
// loaded (the key's scale multiplies its scores, the value's is folded into its softmax
// weight), so the pool is read in place whatever its format.
//
// A soft-capped layer (Gemma 2) passes `softcap` > 0: each score s becomes softcap * tanh(s /
// softcap) before the softmax; 0 leaves the scores alone (one branch a block).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int BLOCK = 16;  // keys per softmax step; the next block's rows are prefetched meanwhile
constexpr int VCHUNK = 16;  // output lanes a value pass keeps in registers

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// fp8 -> fp32 with integer ops only (no branch, no fp32 subnormal, so the loops vectorize and
// never take a microcode assist: real keys have many values far below their head's largest).
// A normal fp8 moves its exponent and mantissa bits into an fp32 and adds the difference of the
// exponent biases (127 - 7 for e4m3, 127 - 15 for e5m2) to the exponent. A subnormal one
// (exponent 0) is its mantissa over the smallest normal: 2^emin * (1 + m) - 2^emin. The pool
// never holds fp8 NaN or infinity: values are clamped when written.
template <int MANTISSA_BITS, int BIAS>
inline float fp8_bits_to_float(uint8_t x) {
  constexpr int SHIFT = 23 - MANTISSA_BITS;
  constexpr uint32_t MIN_NORMAL_EXP = static_cast<uint32_t>(127 + 1 - BIAS) << 23;  // 2^(1 - BIAS)
  const uint32_t magnitude = x & 0x7F;
  const uint32_t normal_bits = (magnitude << SHIFT) + (static_cast<uint32_t>(127 - BIAS) << 23);
  const uint32_t padded_bits = MIN_NORMAL_EXP | (magnitude << SHIFT);  // exponent 0 here: 2^emin * (1 + m)
  float padded, min_normal;
  std::memcpy(&padded, &padded_bits, sizeof(padded));
  std::memcpy(&min_normal, &MIN_NORMAL_EXP, sizeof(min_normal));
  const float subnormal = padded - min_normal;
  uint32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, sizeof(subnormal_bits));
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>((magnitude >> MANTISSA_BITS) == 0);  // all ones or zero
  const uint32_t bits = (subnormal_bits & is_subnormal) | (normal_bits & ~is_subnormal) | (static_cast<uint32_t>(x & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <>
inline float to_float(c10::Float8_e4m3fn x) { return fp8_bits_to_float<3, 7>(x.x); }

template <>
inline float to_float(c10::Float8_e5m2 x) { return fp8_bits_to_float<2, 15>(x.x); }

// tanh(x) as sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: branch-free, so the soft-cap
// loop vectorizes (std::tanh does not), and accurate to a few ulp.
inline float tanh_vec(float x) {
  const float e = radixlm::exp_nonpositive(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
}

// Soft-cap n scores in place: s -> cap * tanh(s / cap).
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.0f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = cap * tanh_vec(s[j] * inv);
}

// The scale of (slot, head), or 1 for an unscaled pool.
inline float scale_at(const c10::Half* scales, int64_t slot, int64_t kv_heads, int64_t h) {
  return scales == nullptr ? 1.0f : static_cast<float>(scales[slot * kv_heads + h]);
}


// Ask the cache for the key and value rows (every KV head: one contiguous run per slot) at slots[begin:end].
template <typename T>
inline void prefetch_rows(const T* k_pool, const T* v_pool, const int64_t* slots, int64_t begin, int64_t end,
                          int64_t row_elems) {
  for (int64_t j = begin; j < end; ++j) {
    const char* kp = reinterpret_cast<const char*>(k_pool + slots[j] * row_elems);
    const char* vp = reinterpret_cast<const char*>(v_pool + slots[j] * row_elems);
    for (int64_t off = 0; off < row_elems * static_cast<int64_t>(sizeof(T)); off += 64) {
      __builtin_prefetch(kp + off);
      __builtin_prefetch(vp + off);
    }
  }
}

// CAPPED: the scores are soft-capped at `softcap` (a separate instantiation, so that the plain
// kernel's code is exactly what it was without soft-capping).
template <typename T, bool CAPPED>
void decode_rows(const float* q, const T* k_pool, const T* v_pool, const c10::Half* k_scale, const c10::Half* v_scale,
                 const int64_t* table, const int64_t* table_rows, const int64_t* starts, const int64_t* lens,
                 const float* init_out, const float* init_lse, float* out, float* lse, int64_t rows, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t table_stride, float scale, float softcap, int64_t splits,
                 float* part_out, float* part_lse) {
  const int64_t group = heads / kv_heads;
  // Chunk s of every row writes to part_out/part_lse [rows, splits, heads(, dim)], merged below;
  // with one chunk the task writes the result itself.
  float* o_base = splits == 1 ? out : part_out;
  float* l_base = splits == 1 ? lse : part_lse;
  // One task per (row, chunk) walks every KV head of each block of slots in turn, so it reads
  // each slot's keys and values whole (one contiguous run per slot) rather than one head's slice
  // of it per task: the reads stay sequential where the slots are, which the hardware prefetches.
  // Only when those tasks are fewer than the threads are the KV heads cut into `head_groups`
  // groups of `per_group` (each head's arithmetic is the same either way, so the result is too).
  const int64_t threads = at::get_num_threads(), row_tasks = rows * splits;
  const int64_t head_groups = row_tasks >= threads ? 1 : std::min(kv_heads, (threads + row_tasks - 1) / row_tasks);
  const int64_t per_group = (kv_heads + head_groups - 1) / head_groups;
  at::parallel_for(0, row_tasks * head_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), scores(group * BLOCK), m(heads), l(heads), rowf(dim);  // rowf: one key or value row in fp32
    std::vector<float> vscale(BLOCK);  // the block's value scales (1 for an unscaled pool)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (splits * head_groups), c = task / head_groups % splits;
      const int64_t h_begin = task % head_groups * per_group, h_end = std::min(kv_heads, h_begin + per_group);
      const int64_t q_begin = h_begin * group, q_end = h_end * group;  // the query heads of those KV heads
      if (h_begin >= h_end) continue;
      for (int64_t hh = q_begin; hh < q_end; ++hh) {
        const float* src = q + (r * heads + hh) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[hh * dim + d] = src[d] * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      if (init_out != nullptr && c == 0) {  // continue from an earlier part (a shared prefix): its output and lse
        for (int64_t hh = q_begin; hh < q_end; ++hh) {
          const int64_t head = r * heads + hh;
          if (std::isinf(init_lse[head])) continue;  // no earlier part for this row
          m[hh] = init_lse[head];
          l[hh] = 1.0f;  // the output is normalized: its weights sum to exp(lse - m) = 1
          std::copy(init_out + head * dim, init_out + (head + 1) * dim, acc.begin() + hh * dim);
        }
      }
      const int64_t chunk = (lens[r] + splits * BLOCK - 1) / (splits * BLOCK) * BLOCK;  // whole blocks
      const int64_t first = std::min<int64_t>(c * chunk, lens[r]);
      const int64_t* slots = table + table_rows[r] * table_stride + starts[r] + first;
      const int64_t n = std::min<int64_t>(chunk, lens[r] - first);
      prefetch_rows(k_pool, v_pool, slots, 0, std::min<int64_t>(n, BLOCK), kv_heads * dim);
      for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
        const int64_t nb = std::min<int64_t>(BLOCK, n - j0);
        // Slots may be scattered in the pool, where the hardware prefetcher cannot see ahead: ask
        // for the next block's key and value rows now, while this block computes.
        prefetch_rows(k_pool, v_pool, slots, j0 + BLOCK, std::min<int64_t>(n, j0 + 2 * BLOCK), kv_heads * dim);
        for (int64_t h = h_begin; h < h_end; ++h) {
          for (int64_t j = 0; j < nb; ++j) {  // one key row at a time, converted once for the whole group
            const T* kr = k_pool + (slots[j0 + j] * kv_heads + h) * dim;
            const float ks = scale_at(k_scale, slots[j0 + j], kv_heads, h);
            for (int64_t d = 0; d < dim; ++d) rowf[d] = to_float(kr[d]);
            for (int64_t g = 0; g < group; ++g) {
              const float* qg = qf.data() + (h * group + g) * dim;
              scores[g * BLOCK + j] = radixlm::dot(qg, rowf.data(), dim) * ks;
            }
          }
          if constexpr (CAPPED) {
            for (int64_t g = 0; g < group; ++g) soft_cap(scores.data() + g * BLOCK, nb, softcap);
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t hg = h * group + g;
            float* sg = scores.data() + g * BLOCK;
            float block_max = sg[0];
            for (int64_t j = 1; j < nb; ++j) block_max = std::max(block_max, sg[j]);
            const float new_m = std::max(m[hg], block_max);
            const float correction = std::exp(m[hg] - new_m);
            float* ag = acc.data() + hg * dim;
            if (correction != 1.0f) {
              for (int64_t d = 0; d < dim; ++d) ag[d] *= correction;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < nb; ++j) {
              sg[j] = radixlm::exp_nonpositive(sg[j] - new_m);
              sum += sg[j];
            }
            l[hg] = l[hg] * correction + sum;
            m[hg] = new_m;
          }
          for (int64_t j = 0; j < nb; ++j) vscale[j] = scale_at(v_scale, slots[j0 + j], kv_heads, h);
          if (dim % VCHUNK == 0) {
            // VCHUNK output lanes of one head at a time, kept in registers over the block's values
            for (int64_t d0 = 0; d0 < dim; d0 += VCHUNK) {
              for (int64_t g = 0; g < group; ++g) {
                float* ag = acc.data() + (h * group + g) * dim + d0;
                const float* pg = scores.data() + g * BLOCK;
                float a[VCHUNK];
                for (int d = 0; d < VCHUNK; ++d) a[d] = ag[d];
                for (int64_t j = 0; j < nb; ++j) {
                  const T* vr = v_pool + (slots[j0 + j] * kv_heads + h) * dim + d0;
                  const float p = pg[j] * vscale[j];
#pragma omp simd
                  for (int d = 0; d < VCHUNK; ++d) a[d] += p * to_float(vr[d]);
                }
                for (int d = 0; d < VCHUNK; ++d) ag[d] = a[d];
              }
            }
          } else {
            for (int64_t j = 0; j < nb; ++j) {  // each value row converted once for the whole group
              const T* vr = v_pool + (slots[j0 + j] * kv_heads + h) * dim;
              for (int64_t d = 0; d < dim; ++d) rowf[d] = to_float(vr[d]);
              for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * BLOCK + j] * vscale[j];
                float* ag = acc.data() + (h * group + g) * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) ag[d] += p * rowf[d];
              }
            }
          }
        }
      }
      for (int64_t hh = q_begin; hh < q_end; ++hh) {
        const int64_t at = (r * splits + c) * heads + hh;
        float* dst = o_base + at * dim;
        if (l[hh] == 0.0f) {  // nothing to attend to: an empty part, which a merge weighs as zero
          std::fill(dst, dst + dim, 0.0f);
          l_base[at] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float inv = 1.0f / l[hh];
        for (int64_t d = 0; d < dim; ++d) dst[d] = acc[hh * dim + d] * inv;
        l_base[at] = m[hh] + std::log(l[hh]);
      }
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {  // merge the chunks by their lse
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / heads, head = rh % heads;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < splits; ++c) top = std::max(top, part_lse[(r * splits + c) * heads + head]);
      float* dst = out + rh * dim;
      std::fill(dst, dst + dim, 0.0f);
      if (std::isinf(top)) {  // every chunk empty
        lse[rh] = top;
        continue;
      }
      float total = 0.0f;
      for (int64_t c = 0; c < splits; ++c) {
        const int64_t at = (r * splits + c) * heads + head;
        const float w = std::exp(part_lse[at] - top);  // 0 for an empty chunk
        if (w == 0.0f) continue;
        total += w;
        const float* src = part_out + at * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += w * src[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inv;
      lse[rh] = top + std::log(total);
    }
  });
}

}  // namespace

// q [B, H, D] (any float dtype); k_pool, v_pool [N, Hkv, D] (fp32, bf16, fp16, int8 or fp8);
// table [R, S] int64 (the request -> slot table); rows [B] selects each query's table row;
// starts/lens [B]: the positions of that row to attend to.
// init_out [B, H, D] and init_lse [B, H] (fp32, optional): an earlier part of each row's attention
// (lse -inf where a row has none) that the result continues.
// k_scale, v_scale [N, Hkv] fp16 (optional, required for int8 and fp8 pools): per (slot, head) scales.
// softcap > 0: scores soft-capped at it (0: none).
// Returns (out [B, H, D] fp32, lse [B, H] fp32).
std::vector<torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                        torch::Tensor table, torch::Tensor rows, torch::Tensor starts,
                                        torch::Tensor lens, double scale, c10::optional<torch::Tensor> init_out,
                                        c10::optional<torch::Tensor> init_lse, c10::optional<torch::Tensor> k_scale,
                                        c10::optional<torch::Tensor> v_scale, int64_t splits, double softcap) {
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3, "q must be [B, H, D] and the pool [N, Hkv, D]");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "the K and V pools must share a dtype");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == torch::kLong, "table must be a contiguous int64 tensor");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the pool tensors must be contiguous");
  const auto kv_type = k_pool.scalar_type();
  const bool eight_bit = kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn || kv_type == at::kFloat8_e5m2;
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale come together");
  TORCH_CHECK(k_scale.has_value() == eight_bit, "int8 and fp8 pools need their scales, other pools take none");
  if (eight_bit) {
    for (const auto& s : {*k_scale, *v_scale}) {
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.numel() == k_pool.size(0) * k_pool.size(1),
                  "scales must be contiguous fp16 [N, Hkv]");
    }
  }
  auto qc = q.to(torch::kFloat).contiguous();
  auto rw = rows.to(torch::kLong).contiguous();
  auto st = starts.to(torch::kLong).contiguous();
  auto ln = lens.to(torch::kLong).contiguous();
  const int64_t b = qc.size(0), heads = qc.size(1), dim = qc.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(init_out.has_value() == init_lse.has_value(), "init_out and init_lse come together");
  torch::Tensor io, il;
  if (init_out.has_value()) {
    io = init_out->to(torch::kFloat).contiguous();
    il = init_lse->to(torch::kFloat).contiguous();
    TORCH_CHECK(io.numel() == b * heads * dim && il.numel() == b * heads, "init_out must be [B, H, D] and init_lse [B, H]");
  }
  auto out = torch::empty({b, heads, dim}, qc.options().dtype(torch::kFloat));
  auto lse = torch::empty({b, heads}, qc.options().dtype(torch::kFloat));
  torch::Tensor part_out, part_lse;  // the chunks' partial results, when a row is split
  if (splits > 1) {
    part_out = torch::empty({b, splits, heads, dim}, qc.options().dtype(torch::kFloat));
    part_lse = torch::empty({b, splits, heads}, qc.options().dtype(torch::kFloat));
  }
  const c10::Half* ks = eight_bit ? k_scale->data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs = eight_bit ? v_scale->data_ptr<c10::Half>() : nullptr;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto call = [&](auto capped) {
      decode_rows<T, decltype(capped)::value>(
          qc.data_ptr<float>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), ks, vs, table.data_ptr<int64_t>(),
          rw.data_ptr<int64_t>(), st.data_ptr<int64_t>(), ln.data_ptr<int64_t>(),
          io.defined() ? io.data_ptr<float>() : nullptr, il.defined() ? il.data_ptr<float>() : nullptr,
          out.data_ptr<float>(), lse.data_ptr<float>(), b, heads, kv_heads, dim, table.size(1),
          static_cast<float>(scale), static_cast<float>(softcap), splits,
          part_out.defined() ? part_out.data_ptr<float>() : nullptr, part_lse.defined() ? part_lse.data_ptr<float>() : nullptr);
    };
    if (softcap > 0.0) {
      call(std::true_type{});
    } else {
      call(std::false_type{});
    }
  };
  switch (kv_type) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported pool dtype ", kv_type);
  }
  return {out, lse};
}
