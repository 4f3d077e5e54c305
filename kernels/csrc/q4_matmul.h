// The 4-bit weight kernel of q4_linear.cpp, free of torch so that tests can build it for other
// instruction sets (AVX2 without VNNI, plain C++) and compare each with the reference.
//
// W is quantized as GGUF's Q4_1 does it: blocks of 32 weights w = d * q + m (q in 0..15, fp16 d
// and m). Rows are stored in tiles of four, block by block: block g of a tile holds the 4 rows'
// d, their 4 m, then each row's 16 bytes of codes (byte j: element j in the low nibble, element
// j + 16 in the high one). A thread so reads one sequential stream, converts 4 scales at once and
// computes 4 rows side by side.
//
// A row's dot product is sum_g d_g * (q_g . x_g) + m_g * sum(x_g). As in llama.cpp, x is first
// quantized to 8 bits per block of 32, so q_g . x_g is an integer dot product (VNNI where the
// CPU has it, else AVX2's byte multiply-add).
//
// GGUF's Q4_0 (w = d * (q - 8): m = -8 d, exact) has its own tiles, without the minimums: block
// g of a tile is the 4 rows' d, then their codes (72 bytes, the file's 18 per block and row); its
// m is computed as -8 d, so it multiplies exactly as its Q4_1 form would, in 10% fewer bytes.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixlm::q4 {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockBytes = 20;
constexpr int kTile = 4;  // weight rows stored interleaved, block by block, and computed together
constexpr int64_t kTileBlockBytes = kTile * kBlockBytes;  // block g of a tile's 4 rows
constexpr int64_t kQ4_0TileBlockBytes = kTile * 18;  // the same in Q4_0 tiles

// Bytes of block g of a tile, and where its codes start.
template <bool kQ4_0>
constexpr int64_t tile_block_bytes() { return kQ4_0 ? kQ4_0TileBlockBytes : kTileBlockBytes; }
template <bool kQ4_0>
constexpr int64_t codes_at() { return kQ4_0 ? 8 : 16; }

// The IEEE half at p (unaligned) as a float.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, frac = h & 0x3FFu;
  float out;
  if (exp == 0) {  // zero or subnormal: frac * 2^-24
    out = std::ldexp(static_cast<float>(frac), -24);
    return sign ? -out : out;
  }
  const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (frac << 13) : ((exp + 112) << 23) | (frac << 13));
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXLM_Q4_AVX2 1
// For two weight rows at once (v: their 16 nibble bytes side by side; lo, hi: their elements
// 0..15 and 16..31), the products with 8-bit x (xl, xh: x's elements 0..15 and 16..31 in both
// halves), summed to 4 int32 per row.
inline __m256i two_rows_dot(__m256i lo, __m256i hi, __m256i xl, __m256i xh) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
  // u8 * s8 pairs fit int16 (2 * 15 * 127), two of them too; then pairs of int16 to int32
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
#endif

#if defined(__AVX512VL__)
constexpr int kXRows = 4;  // rows of x per pass over a tile
#else
constexpr int kXRows = 2;  // what 16 vector registers hold without spilling
#endif
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the tile being read: the stream's next lines

// dot[b * 4 + c] = sum over the blocks g of the tile's weight row c of
// d * dx_b * (q . qx_b) + m * xsum_b, for R rows of x (x_b quantized per block of 32 to
// qx_b * dx_b, 8-bit signed, as GGUF's Q8 blocks are).
template <int R, bool kQ4_0>
void tile_dots(const uint8_t* tile, const int8_t* xq, int64_t k, const float* dx, const float* xsum, int64_t groups,
               float* dot) {
  constexpr int64_t kBytes = tile_block_bytes<kQ4_0>(), kCodes = codes_at<kQ4_0>();
#if defined(RADIXLM_Q4_AVX2)
  __m128 acc[R], macc[R];
  for (int b = 0; b < R; ++b) acc[b] = macc[b] = _mm_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* tb = tile + g * kBytes;
    __builtin_prefetch(tb + kPrefetch);
    __builtin_prefetch(tb + kPrefetch + 64);
    __m128 d, m;
    if constexpr (kQ4_0) {
      d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tb)));
      m = _mm_mul_ps(d, _mm_set1_ps(-8.0f));
    } else {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb)));
      d = _mm256_castps256_ps128(dm);
      m = _mm256_extractf128_ps(dm, 1);
    }
    const __m256i v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + kCodes));
    const __m256i v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + kCodes + 32));
    const __m256i lo01 = _mm256_and_si256(v01, low), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), low);
    const __m256i lo23 = _mm256_and_si256(v23, low), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), low);
    for (int b = 0; b < R; ++b) {
      const int8_t* xb = xq + b * k + g * kGroup;
      const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
      const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16)));
      // rows 0, 1 and rows 2, 3: 4 partial sums each; two horizontal adds leave [r0 r2 r0 r2 | r1 r3 r1 r3]
      __m256i h = _mm256_hadd_epi32(two_rows_dot(lo01, hi01, xl, xh), two_rows_dot(lo23, hi23, xl, xh));
      h = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h, h), order);
      const __m128 p = _mm_cvtepi32_ps(_mm256_castsi256_si128(h));
      acc[b] = _mm_fmadd_ps(_mm_mul_ps(d, _mm_set1_ps(dx[b * groups + g])), p, acc[b]);
      macc[b] = _mm_fmadd_ps(m, _mm_set1_ps(xsum[b * groups + g]), macc[b]);
    }
  }
  for (int b = 0; b < R; ++b) _mm_storeu_ps(dot + b * kTile, _mm_add_ps(acc[b], macc[b]));
#else
  float acc[kTile * R] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* tb = tile + g * kBytes;
    for (int c = 0; c < kTile; ++c) {
      const float d = half_at(tb + 2 * c), m = kQ4_0 ? d * -8.0f : half_at(tb + 8 + 2 * c);
      const uint8_t* nib = tb + kCodes + 16 * c;
      for (int b = 0; b < R; ++b) {
        const int8_t* qb = xq + b * k + g * kGroup;
        int32_t t = 0;
        for (int j = 0; j < 16; ++j) t += (nib[j] & 0x0F) * qb[j] + (nib[j] >> 4) * qb[j + 16];
        acc[b * kTile + c] += d * dx[b * groups + g] * static_cast<float>(t) + m * xsum[b * groups + g];
      }
    }
  }
  for (int i = 0; i < kTile * R; ++i) dot[i] = acc[i];
#endif
}

// x's rows as 8-bit blocks of 32: qx = round(x / dx) with dx = max |x| / 127, and dx * sum(qx).
// The sum is of the quantized x, so that the product is exactly W times the quantized x (with the
// exact sum, the minimum's term and the codes' term would carry the rounding error differently).
inline void quantize_x(const float* x, int64_t rows, int64_t k, int8_t* xq, float* dx, float* xsum) {
  const int64_t groups = k / kGroup;
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* xg = x + i * kGroup;
    float amax = 0.0f;
    for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
      xq[i * kGroup + j] = q;
      sum += q;
    }
    dx[i] = scale;
    xsum[i] = scale * static_cast<float>(sum);
  }
}

// y[b, j] for the tile's weight rows j (those below n) and every row b of x.
template <bool kQ4_0>
inline void tile_rows(const uint8_t* tile, const int8_t* xq, int64_t k, const float* dx, const float* xsum, int64_t groups,
               int64_t rows, int64_t first, int64_t n, float* y) {
  for (int64_t b0 = 0; b0 < rows; b0 += kXRows) {
    const int64_t r = std::min<int64_t>(kXRows, rows - b0);
    float dot[kTile * kXRows];
    const int8_t* qb = xq + b0 * k;
    const float* db = dx + b0 * groups;
    const float* sb = xsum + b0 * groups;
    switch (r) {
      case 1: tile_dots<1, kQ4_0>(tile, qb, k, db, sb, groups, dot); break;
#if defined(__AVX512VL__)
      case 2: tile_dots<2, kQ4_0>(tile, qb, k, db, sb, groups, dot); break;
      case 3: tile_dots<3, kQ4_0>(tile, qb, k, db, sb, groups, dot); break;
      default: tile_dots<4, kQ4_0>(tile, qb, k, db, sb, groups, dot); break;
#else
      default: tile_dots<2, kQ4_0>(tile, qb, k, db, sb, groups, dot); break;
#endif
    }
    for (int64_t c = 0; c < kTile && first + c < n; ++c) {
      for (int64_t b = 0; b < r; ++b) y[(b0 + b) * n + first + c] = dot[b * kTile + c];
    }
  }
}


// Bytes of scratch the quantized x of ``rows`` rows of ``k`` needs (scales, sums, codes).
inline int64_t scratch_bytes(int64_t rows, int64_t k) { return rows * (k / kGroup) * 2 * 4 + rows * k; }

// y[b, j] (row stride n) for the weight rows of tiles [tile_begin, tile_end) (Q4_1 tiles, or
// Q4_0 ones), every row of x, from x already quantized into ``scratch`` by quantize_into.
inline void matmul_tiles(const uint8_t* tiles, const uint8_t* scratch, int64_t rows, int64_t k, int64_t n,
                         int64_t tile_begin, int64_t tile_end, float* y, bool q4_0 = false) {
  const int64_t groups = k / kGroup;
  const float* dx = reinterpret_cast<const float*>(scratch);
  const float* xsum = dx + rows * groups;
  const int8_t* xq = reinterpret_cast<const int8_t*>(xsum + rows * groups);
  const int64_t tile_bytes = groups * (q4_0 ? kQ4_0TileBlockBytes : kTileBlockBytes);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    if (q4_0) {
      tile_rows<true>(tiles + t * tile_bytes, xq, k, dx, xsum, groups, rows, t * kTile, n, y);
    } else {
      tile_rows<false>(tiles + t * tile_bytes, xq, k, dx, xsum, groups, rows, t * kTile, n, y);
    }
  }
}

// x [rows, k] quantized into ``scratch`` (scratch_bytes(rows, k) bytes, 4-byte aligned).
inline void quantize_into(const float* x, int64_t rows, int64_t k, uint8_t* scratch) {
  const int64_t groups = k / kGroup;
  float* dx = reinterpret_cast<float*>(scratch);
  float* xsum = dx + rows * groups;
  quantize_x(x, rows, k, reinterpret_cast<int8_t*>(xsum + rows * groups), dx, xsum);
}

}  // namespace radixlm::q4
