// The FP8 (e4m3) weight kernel of fp8_linear.cpp, free of torch so that tests can build it for
// other instruction sets (plain C++) and compare each with the reference.
//
// W [n, k] is the raw bytes of float8_e4m3fn values, with float32 scales in segments of a row:
// one segment per row (a scale for the tensor or per output row), or blocks of bk inputs
// (block scales, one per [bn, bk] block). A byte's 7 low bits shifted left by 7, with its sign
// moved to bit 15, are the fp16 bits of its value times 2^-8 (the exponents line up, e4m3's bias
// 7 being fp16's 15 less 8, and e4m3's subnormals land on fp16's), exact for every value but NaN;
// F16C converts 8 at once, and the 2^8 is folded into the scales.
//
// Each weight row is read once per pass of up to kXRows rows of x: 16 weights are decoded in
// registers and multiplied into fp32 sums of each x row, which are scaled once per segment.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixlm::fp8 {

constexpr int kXRows = 4;  // rows of x per pass over a weight row
constexpr float kDecodeScale = 256.0f;  // the 2^8 the fp16 trick leaves out

// The e4m3fn value of byte b (NaN for 0x7F and 0xFF), computed without tables.
inline float e4m3_value(uint8_t b) {
  const int exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man / 8 * 2^-6
  } else {
    v = std::ldexp(static_cast<float>(8 + man), exp - 10);  // (1 + man / 8) * 2^(exp - 7)
  }
  return (b & 0x80) ? -v : v;
}

// Every byte's value, for the plain C++ path.
struct Table {
  float value[256];
  Table() {
    for (int i = 0; i < 256; ++i) value[i] = e4m3_value(static_cast<uint8_t>(i));
  }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXLM_FP8_AVX2 1
// 16 e4m3 bytes as two vectors of 8 floats, each value times 2^-8.
inline void decode16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7),
                                       _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
}

// 8 e4m3 bytes as 8 floats, each value times 2^-8.
inline __m256 decode8(const uint8_t* p) {
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7),
                                    _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(bits);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// dot[b] = sum over the row's segments s of scales[s] * (w_s . x_b,s), for R rows of x (row
// stride ldx), the row's k weights at w, segments of seg inputs (the last one shorter).
template <int R>
void row_dots(const uint8_t* w, const float* x, int64_t ldx, int64_t k, const float* scales, int64_t seg, float* dot) {
#if defined(RADIXLM_FP8_AVX2)
  __m256 acc[R];
  float tail[R];
  for (int b = 0; b < R; ++b) acc[b] = _mm256_setzero_ps(), tail[b] = 0.0f;
  for (int64_t k0 = 0, s = 0; k0 < k; k0 += seg, ++s) {
    const int64_t k1 = std::min(k, k0 + seg);
    __m256 lo_acc[R], hi_acc[R];
    float seg_tail[R];
    for (int b = 0; b < R; ++b) lo_acc[b] = hi_acc[b] = _mm256_setzero_ps(), seg_tail[b] = 0.0f;
    int64_t j = k0;
    for (; j + 16 <= k1; j += 16) {
      __m256 lo, hi;
      decode16(w + j, lo, hi);
      for (int b = 0; b < R; ++b) {
        lo_acc[b] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + b * ldx + j), lo_acc[b]);
        hi_acc[b] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + b * ldx + j + 8), hi_acc[b]);
      }
    }
    if (j + 8 <= k1) {
      const __m256 lo = decode8(w + j);
      for (int b = 0; b < R; ++b) lo_acc[b] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + b * ldx + j), lo_acc[b]);
      j += 8;
    }
    for (; j < k1; ++j) {
      const float v = e4m3_value(w[j]) / kDecodeScale;
      for (int b = 0; b < R; ++b) seg_tail[b] += v * x[b * ldx + j];
    }
    const float sc = scales[s] * kDecodeScale;
    const __m256 sv = _mm256_set1_ps(sc);
    for (int b = 0; b < R; ++b) {
      acc[b] = _mm256_fmadd_ps(_mm256_add_ps(lo_acc[b], hi_acc[b]), sv, acc[b]);
      tail[b] += seg_tail[b] * sc;
    }
  }
  for (int b = 0; b < R; ++b) dot[b] = hsum(acc[b]) + tail[b];
#else
  static const Table table;
  float acc[R] = {};
  for (int64_t k0 = 0, s = 0; k0 < k; k0 += seg, ++s) {
    const int64_t k1 = std::min(k, k0 + seg);
    float part[R] = {};
    for (int64_t j = k0; j < k1; ++j) {
      const float v = table.value[w[j]];
      for (int b = 0; b < R; ++b) part[b] += v * x[b * ldx + j];
    }
    for (int b = 0; b < R; ++b) acc[b] += part[b] * scales[s];
  }
  for (int b = 0; b < R; ++b) dot[b] = acc[b];
#endif
}

// y[b, i] (row stride n) for the weight rows i in [row_begin, row_end) and the m rows of x [m, k].
// Row i's scale for its segment s (of seg inputs) is scale[(i / rows_per_scale) * scale_stride + s]:
// per tensor (n, 0, k), per row (1, 1, k), or [bn, bk] blocks (bn, ceil(k / bk), bk).
inline void matmul_rows(const float* x, int64_t m, int64_t k, const uint8_t* w, const float* scale,
                        int64_t rows_per_scale, int64_t scale_stride, int64_t seg, int64_t n, int64_t row_begin,
                        int64_t row_end, float* y) {
  seg = std::max<int64_t>(seg, 1);
  rows_per_scale = std::max<int64_t>(rows_per_scale, 1);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const uint8_t* wr = w + i * k;
    const float* sr = scale + (i / rows_per_scale) * scale_stride;
    for (int64_t b0 = 0; b0 < m; b0 += kXRows) {
      const int64_t r = std::min<int64_t>(kXRows, m - b0);
      float dot[kXRows];
      const float* xb = x + b0 * k;
      switch (r) {
        case 1: row_dots<1>(wr, xb, k, k, sr, seg, dot); break;
        case 2: row_dots<2>(wr, xb, k, k, sr, seg, dot); break;
        case 3: row_dots<3>(wr, xb, k, k, sr, seg, dot); break;
        default: row_dots<4>(wr, xb, k, k, sr, seg, dot); break;
      }
      for (int64_t b = 0; b < r; ++b) y[(b0 + b) * n + i] = dot[b];
    }
  }
}

}  // namespace radixlm::fp8
