// Branch-free float math that compilers vectorize (std::exp calls are not vectorized).
#pragma once

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

}  // namespace radixlm
