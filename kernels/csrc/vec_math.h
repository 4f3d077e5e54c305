// Branch-free float math that compilers vectorize (std::exp calls are not vectorized), and a
// float dot product with its horizontal sum in registers.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixlm {

// exp(x) for x <= 0 as 2^n * e^f (n integer, |f| <= ln(2)/2, e^f by its degree-6 Taylor
// polynomial: relative error ~1e-7). Below -126*ln(2) it returns a tiny normal number, not 0.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -126.0f * 0.69314718055994531f) * 1.44269504088896341f;  // in base 2
  // n = t rounded to the nearest integer by adding 1.5 * 2^23, which leaves it in the low bits
  // of the sum's mantissa: std::floor, or a float-to-int conversion after the clamp, makes GCC
  // keep the whole loop scalar
  constexpr float kRound = 12582912.0f;
  const float shifted = t + kRound;
  const float n = shifted - kRound;
  int32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const int32_t ni = shifted_bits - 0x4B400000;  // the bits of kRound
  const float f = (t - n) * 0.69314718055994531f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// sum(a[i] * b[i]) over n floats. GCC reduces an `omp simd` sum by storing the vector and adding
// its lanes one after another from memory; here two 8-lane accumulators are summed by halving in
// registers, and the tail (n not a multiple of 8) is added one by one. (On an AMD EPYC with
// AVX-512, 8 lanes did a 64-wide dot faster than 16: the shorter horizontal sum wins.)
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  sum = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace radixlm
