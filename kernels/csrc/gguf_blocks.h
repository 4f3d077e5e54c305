// GGUF's quantized block formats multiplied as stored, free of torch so that tests can build it
// for other instruction sets (AVX2 without VNNI, plain C++) and compare each with the reference.
//
// A weight row of K values is K / weights-per-block consecutive blocks, exactly the bytes of the
// GGUF tensor's row. As in llama.cpp's CPU backend, x is first quantized to 8 bits per 32
// (q4_matmul.h's quantize_into: codes qx, scale dx and dx * sum(qx) per 32), so each sub-block of
// 32 weights, written w = D * c + M (c: integer codes, D and M: floats of the block), contributes
// D * dx * (c . qx) + M * dx * sum(qx): an integer dot product and two float multiply-adds.
//
// Supported (ggml ids): Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
// Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39, and ours, Q4_Z = 1024 (AWQ/GPTQ with zero
// points: 20 bytes for 32 weights: fp16 d, uint8 zero z, one unused byte, 16 bytes of codes in
// Q4_0's order; w = d * (q - z)).
//
// The AVX2 path reads 8 sub-blocks of 32 at a time (one K-quant super-block, or 8 small blocks):
// it decodes their codes once, then for each row of x computes the 8 integer dot products, sums
// each to one lane (8 lanes, one per sub-block) and applies the 8 scales with one multiply-add.
// With AVX-512 VNNI, one row of x against Q6_K takes two sub-blocks a 64-byte vector instead
// (the same integers, summed to the same 8 lanes). The plain C++ path computes the same sums one
// sub-block at a time.
#pragma once

#include <vector>

#include "q4_matmul.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define RADIXLM_GGUF_AVX512 1  // 64-byte vectors with VNNI: Q6_K's one-row kernel and the interleaved kernel
#endif

namespace radixlm::gguf {

using q4::half_at;
using q4::kGroup;  // x is quantized per 32: every type's sub-block

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39, kQ4_Z = 1024;
constexpr int kTypes[] = {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kMXFP4, kQ4_Z};

// IQ4_NL's (and IQ4_XS's) 16 code values.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's 16 E2M1 values, doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, times 2).
alignas(16) constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 exponent byte as ggml reads MXFP4's scale, halved (the values are doubled): 2^(e - 128),
// with e = 0 and 1 as the subnormals 2^-128 and 2^-127.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A signed 4-bit-packed pair's Q4_0 order: byte j of 16 holds element j (low nibble) and j + 16 (high).
inline void nibbles(const uint8_t* qs, int32_t* c) {
  for (int j = 0; j < 16; ++j) {
    c[j] = qs[j] & 0x0F;
    c[j + 16] = qs[j] >> 4;
  }
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Q4_K's and Q5_K's 8 6-bit scales and 8 6-bit mins from their 12 packed bytes.
inline void k_scales(const uint8_t* p, uint8_t* sc, uint8_t* mn) {
  const uint32_t a = u32_at(p), b = u32_at(p + 4), c = u32_at(p + 8);
  const uint32_t s[2] = {a & 0x3F3F3F3Fu, (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)};
  const uint32_t m[2] = {b & 0x3F3F3F3Fu, ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)};
  std::memcpy(sc, s, 8);
  std::memcpy(mn, m, 8);
}

#if defined(RADIXLM_Q4_AVX2)
// The decoded codes of 8 sub-blocks of 32 (sub-block i: q[i], unsigned codes, or the absolute
// values of signed ones with their signs in aux[i]; Q6_K: aux[i] its two scales as int16), and
// their 8 scales D and mins M.
struct Chunk {
  __m256i q[8], aux[8];
  __m256 d, m;
};

// The 32 products of unsigned codes q (u8) and x (s8), summed to 8 int32.
inline __m256i dot_us(__m256i q, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x);
#else
  // pairs of products fit int16: codes are at most 31, or |c| <= 128 for signed ones (2 * 128 * 127 < 2^15)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

// 16 nibble bytes (Q4_0 order) as 32 bytes of codes 0..15 in element order.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Bit j of ``bits`` as byte j: 0x10 where set, else 0 (Q5_0's and Q5_1's fifth bit).
inline __m256i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(0x10));  // the bits as a byte mask
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

// The fp16 at p + i * stride for i < n (0 beyond), as 8 floats: gathered in two integer registers
// by shifts and ors on the integer ports (an insert per word would take two vector uops, and
// halves stored to memory and read back as a vector stall the store forwarding); past n, the last
// one is read again, then zeroed.
inline __m256 halves8(const uint8_t* p, int64_t stride, int n) {
  uint64_t lo = 0, hi = 0;
  for (int i = 0; i < 4; ++i) {
    uint16_t a, b;
    std::memcpy(&a, p + std::min(i, n - 1) * stride, 2);
    std::memcpy(&b, p + std::min(i + 4, n - 1) * stride, 2);
    lo |= static_cast<uint64_t>(a) << (16 * i);
    hi |= static_cast<uint64_t>(b) << (16 * i);
  }
  __m128i v = _mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo));
  if (n < 8) v = _mm_and_si128(v, _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<int16_t>(n)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7)));
  return _mm256_cvtph_ps(v);
}

// The fp16 pairs (d, m) at p + i * stride for i < n (0 beyond), as 8 floats each: each pair read
// as one dword, 2 to an integer register, then split into d's and m's by one shuffle.
inline void half_pairs8(const uint8_t* p, int64_t stride, int n, __m256& d, __m256& m) {
  uint64_t q[4];
  for (int j = 0; j < 4; ++j) {
    const uint64_t a = u32_at(p + std::min(2 * j, n - 1) * stride), b = u32_at(p + std::min(2 * j + 1, n - 1) * stride);
    q[j] = a | (b << 32);
  }
  __m256i v = _mm256_setr_epi64x(static_cast<long long>(q[0]), static_cast<long long>(q[1]), static_cast<long long>(q[2]),
                                 static_cast<long long>(q[3]));
  if (n < 8) v = _mm256_and_si256(v, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  // each 128-bit half: its 4 d's, then its 4 m's; then the halves' d's together, and their m's
  const __m256i split = _mm256_shuffle_epi8(
      v, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i dm = _mm256_permute4x64_epi64(split, _MM_SHUFFLE(3, 1, 2, 0));
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

// Signed codes split as the kernel multiplies them: |c| (unsigned) and c (its signs).
inline void signed_codes(__m256i c, Chunk& ch, int i) {
  ch.q[i] = _mm256_abs_epi8(c);
  ch.aux[i] = c;
}

// Q4_K's and Q5_K's block header (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins) as the
// chunk's 8 scales D = d * sc and 8 mins M = -dmin * mn (k_scales' unpacking, in vector registers).
inline void k_header(const uint8_t* b, Chunk& ch) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // dwords: a, b, c, (codes)
  const __m128i acbc = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));
  const __m128i aabb = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(acbc, _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi32(aabb, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i scmn = _mm_or_si128(low, high);  // bytes 0..7: the scales, 8..15: the mins
  // d and -dmin (the sign bit flipped as a half: exact)
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32_at(b) ^ 0x80000000u)));
  ch.d = _mm256_mul_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scmn)));
  ch.m = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scmn, scmn))));
}

// IQ4 nibbles (Q4_0 order) as their signed code values.
inline __m256i iq4_values(const uint8_t* qs) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  return _mm256_shuffle_epi8(table, nibbles32(qs));
}

// MXFP4 nibbles (Q4_0 order) as their signed (doubled) values.
inline __m256i mxfp4_values(const uint8_t* qs) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMXFP4Values)));
  return _mm256_shuffle_epi8(table, nibbles32(qs));
}

// The E8M0 bytes at p + i * stride for i < n (0 beyond), as 8 floats e8m0_half: gathered in one
// integer register, widened, and turned into float bits by shifts (a blend for the subnormals).
inline __m256 e8m0_halves8(const uint8_t* p, int64_t stride, int n) {
  uint64_t bytes = 0;
  for (int i = 0; i < 8; ++i) bytes |= static_cast<uint64_t>(p[std::min(i, n - 1) * stride]) << (8 * i);
  const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  __m256i bits = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
  if (n < 8) bits = _mm256_and_si256(bits, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  return _mm256_castsi256_ps(bits);
}
#endif

// Each type: kId, kWeights and kBytes (one block), kSubs (sub-blocks of 32 in a block), kMin
// (whether w has the additive M term); sub(): sub-block s of a block as integer codes c and
// floats D[2] (for its elements 0..15 and 16..31) and M, w = D * c + M, in the order of GGUF's
// dequantize (so dequantize() is exact); and for AVX2, load() of 8 sub-blocks and the signedness.

struct Q4_0 {
  static constexpr int kId = kQ4_0, kWeights = 32, kBytes = 18, kSubs = 1;
  static constexpr bool kMin = false, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    nibbles(b + 2, c);
    for (int j = 0; j < 32; ++j) c[j] -= 8;
    d[0] = d[1] = half_at(b);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  // codes are kept unsigned (0..15): w = d * q - 8 d
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) ch.q[i] = nibbles32(b + i * kBytes + 2);
    ch.d = halves8(b, kBytes, n);
    ch.m = _mm256_mul_ps(ch.d, _mm256_set1_ps(-8.0f));
  }
#endif
};

struct Q4_1 {
  static constexpr int kId = kQ4_1, kWeights = 32, kBytes = 20, kSubs = 1;
  static constexpr bool kMin = true, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    nibbles(b + 4, c);
    d[0] = d[1] = half_at(b);
    m = half_at(b + 2);
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) ch.q[i] = nibbles32(b + i * kBytes + 4);
    half_pairs8(b, kBytes, n, ch.d, ch.m);
  }
#endif
};

struct Q5_0 {
  static constexpr int kId = kQ5_0, kWeights = 32, kBytes = 22, kSubs = 1;
  static constexpr bool kMin = false, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    const uint32_t qh = u32_at(b + 2);
    nibbles(b + 6, c);
    for (int j = 0; j < 32; ++j) c[j] = (c[j] | static_cast<int32_t>(((qh >> j) & 1u) << 4)) - 16;
    d[0] = d[1] = half_at(b);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) {
      const uint8_t* bi = b + i * kBytes;
      ch.q[i] = _mm256_or_si256(nibbles32(bi + 6), fifth_bits(u32_at(bi + 2)));
    }
    ch.d = halves8(b, kBytes, n);
    ch.m = _mm256_mul_ps(ch.d, _mm256_set1_ps(-16.0f));
  }
#endif
};

struct Q5_1 {
  static constexpr int kId = kQ5_1, kWeights = 32, kBytes = 24, kSubs = 1;
  static constexpr bool kMin = true, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    const uint32_t qh = u32_at(b + 4);
    nibbles(b + 8, c);
    for (int j = 0; j < 32; ++j) c[j] |= static_cast<int32_t>(((qh >> j) & 1u) << 4);
    d[0] = d[1] = half_at(b);
    m = half_at(b + 2);
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) {
      const uint8_t* bi = b + i * kBytes;
      ch.q[i] = _mm256_or_si256(nibbles32(bi + 8), fifth_bits(u32_at(bi + 4)));
    }
    half_pairs8(b, kBytes, n, ch.d, ch.m);
  }
#endif
};

struct Q8_0 {
  static constexpr int kId = kQ8_0, kWeights = 32, kBytes = 34, kSubs = 1;
  static constexpr bool kMin = false, kSigned = true, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    for (int j = 0; j < 32; ++j) c[j] = static_cast<int8_t>(b[2 + j]);
    d[0] = d[1] = half_at(b);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = false;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) signed_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * kBytes + 2)), ch, i);
    ch.d = halves8(b, kBytes, n);
  }
#endif
};

struct IQ4_NL {
  static constexpr int kId = kIQ4_NL, kWeights = 32, kBytes = 18, kSubs = 1;
  static constexpr bool kMin = false, kSigned = true, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    nibbles(b + 2, c);
    for (int j = 0; j < 32; ++j) c[j] = kIQ4Values[c[j]];
    d[0] = d[1] = half_at(b);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = false;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) signed_codes(iq4_values(b + i * kBytes + 2), ch, i);
    ch.d = halves8(b, kBytes, n);
  }
#endif
};

// MXFP4 (GPT-OSS's experts): 32 weights in 17 bytes: an E8M0 exponent byte, then 16 bytes of E2M1
// codes in Q4_0's order indexing kMXFP4Values; w = e8m0_half(e) * value.
struct MXFP4 {
  static constexpr int kId = kMXFP4, kWeights = 32, kBytes = 17, kSubs = 1;
  static constexpr bool kMin = false, kSigned = true, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    nibbles(b + 1, c);
    for (int j = 0; j < 32; ++j) c[j] = kMXFP4Values[c[j]];
    d[0] = d[1] = e8m0_half(b[0]);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = false;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    for (int i = 0; i < n; ++i) signed_codes(mxfp4_values(b + i * kBytes + 1), ch, i);
    ch.d = e8m0_halves8(b, kBytes, n);
  }
#endif
};

struct Q4_Z {
  static constexpr int kId = kQ4_Z, kWeights = 32, kBytes = 20, kSubs = 1;
  static constexpr bool kMin = false, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int, int32_t* c, float* d, float& m) {
    nibbles(b + 4, c);
    for (int j = 0; j < 32; ++j) c[j] -= b[2];
    d[0] = d[1] = half_at(b);
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  // codes are kept unsigned (0..15): w = d * q - d * z
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int n, Chunk& ch) {
    const uint8_t* b = row + g0 * kBytes;
    int32_t z[8];
    for (int i = 0; i < 8; ++i) z[i] = -b[std::min(i, n - 1) * kBytes + 2];  // lanes past n: d is 0
    for (int i = 0; i < n; ++i) ch.q[i] = nibbles32(b + i * kBytes + 4);
    ch.d = halves8(b, kBytes, n);
    ch.m = _mm256_mul_ps(ch.d, _mm256_cvtepi32_ps(_mm256_setr_epi32(z[0], z[1], z[2], z[3], z[4], z[5], z[6], z[7])));
  }
#endif
};

// Q4_K: 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, then 4
// chunks of 32 bytes (chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high ones);
// w = d * sc * q - dmin * mn.
struct Q4_K {
  static constexpr int kId = kQ4_K, kWeights = 256, kBytes = 144, kSubs = 8;
  static constexpr bool kMin = true, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int s, int32_t* c, float* d, float& m) {
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t* qs = b + 16 + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int j = 0; j < 32; ++j) c[j] = (qs[j] >> shift) & 0x0F;
    d[0] = d[1] = half_at(b) * static_cast<float>(sc[s]);
    m = -(half_at(b + 2) * static_cast<float>(mn[s]));
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int, Chunk& ch) {
    const uint8_t* b = row + static_cast<uint64_t>(g0) / kSubs * kBytes;
    k_header(b, ch);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j));
      ch.q[2 * j] = _mm256_and_si256(v, low);
      ch.q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  }
#endif
};

// Q5_K: Q4_K with a fifth bit: 176 bytes: d, dmin, 12 bytes of scales, 32 bytes qh (bit s of
// byte l: sub-block s's element l), 128 bytes of nibbles as Q4_K's.
struct Q5_K {
  static constexpr int kId = kQ5_K, kWeights = 256, kBytes = 176, kSubs = 8;
  static constexpr bool kMin = true, kSigned = false, kQ6 = false;
  static void sub(const uint8_t* b, int s, int32_t* c, float* d, float& m) {
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int j = 0; j < 32; ++j) c[j] = ((qs[j] >> shift) & 0x0F) | (((qh[j] >> s) & 1) << 4);
    d[0] = d[1] = half_at(b) * static_cast<float>(sc[s]);
    m = -(half_at(b + 2) * static_cast<float>(mn[s]));
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = true;
  static void load(const uint8_t* row, int64_t g0, int, Chunk& ch) {
    const uint8_t* b = row + static_cast<uint64_t>(g0) / kSubs * kBytes;
    k_header(b, ch);
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * j));
      // bits 2j and 2j + 1 of each qh byte, moved to bit 4
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4);
      ch.q[2 * j] = _mm256_or_si256(_mm256_and_si256(v, low), h0);
      ch.q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), h1);
    }
  }
#endif
};

// Q6_K: 256 weights in 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16
// int8 scales (one per 16 weights), fp16 d last. Element h * 128 + j * 32 + l (h < 2, j < 4,
// l < 32): low nibble (j < 2) or high nibble (j >= 2) of ql[h * 64 + (j % 2) * 32 + l], bits
// 2j..2j+1 of qh[h * 32 + l]; w = d * sc * (q - 32).
struct Q6_K {
  static constexpr int kId = kQ6_K, kWeights = 256, kBytes = 210, kSubs = 8;
  static constexpr bool kMin = false, kSigned = false, kQ6 = true;
  static void sub(const uint8_t* b, int s, int32_t* c, float* d, float& m) {
    const int h = s / 4, j = s % 4;
    const uint8_t* ql = b + h * 64 + (j % 2) * 32;
    const uint8_t* qh = b + 128 + h * 32;
    for (int l = 0; l < 32; ++l) c[l] = (((ql[l] >> (4 * (j / 2))) & 0x0F) | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
    const float dd = half_at(b + 208);
    d[0] = dd * static_cast<float>(static_cast<int8_t>(b[192 + 2 * s]));
    d[1] = dd * static_cast<float>(static_cast<int8_t>(b[193 + 2 * s]));
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  // codes kept unsigned (0..63); aux[i]: sub-block i's two scales as int16 (8 lanes each)
  static constexpr bool kLoadMin = false;
  static void load(const uint8_t* row, int64_t g0, int, Chunk& ch) {
    const uint8_t* b = row + static_cast<uint64_t>(g0) / kSubs * kBytes;
    ch.d = _mm256_set1_ps(half_at(b + 208));
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      ch.q[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      ch.q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      ch.q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, two));
      ch.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
    }
    // the 16 scales as int16, scales 0..7 (then 8..15) in both halves; sub-block i's pair picked
    // from them by one byte shuffle (scale 2i in the low half, 2i + 1 in the high one)
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m256i first = _mm256_permute2x128_si256(sc, sc, 0x00), second = _mm256_permute2x128_si256(sc, sc, 0x11);
    for (int i = 0; i < 8; ++i) {
      const int lo = (2 * i) % 8, hi = (2 * i + 1) % 8;
      const __m256i pick = _mm256_setr_epi8(
          2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
          2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
          2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1,
          2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1);
      ch.aux[i] = _mm256_shuffle_epi8(i < 4 ? first : second, pick);
    }
  }
#endif
#if defined(RADIXLM_GGUF_AVX512)
  // One row of x (xb: the block's 256 codes) against the block, with the integers load() and
  // sub_dot compute, two sub-blocks a 64-byte vector: z[p] holds sub-blocks 2p (lanes 0..7) and
  // 2p + 1 (lanes 8..15), each lane 4 scaled products.
  static void pairs(const uint8_t* b, const int8_t* xb, __m512i* z) {
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
    // qh's bits for sub-blocks 4h + 0 and 4h + 1 (bits 0-1 and 2-3 of each byte, moved to bits 4-5),
    // then for 4h + 2 and 4h + 3 (bits 4-5 and 6-7)
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    // the 16 scales as int16; word w of sub-block pair (s, s + 1)'s scale vector: scale 2s + w / 8
    const __m512i sc = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    const __m512i pick = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);  // the codes of sub-blocks 4h and 4h + 1 side by side
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      const __m512i q[2] = {
          _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(_mm512_sllv_epi16(qh, up), two)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), _mm512_and_si512(_mm512_srlv_epi16(qh, down), two))};
      for (int p = 0; p < 2; ++p) {
        const int s0 = 4 * h + 2 * p;
        const __m512i x = _mm512_loadu_si512(xb + kGroup * s0);
        const __m512i pairs16 = _mm512_sub_epi16(_mm512_maddubs_epi16(q[p], x), _mm512_maddubs_epi16(c32, x));
        z[s0 / 2] = _mm512_madd_epi16(pairs16, _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16(static_cast<int16_t>(2 * s0))), sc));
      }
    }
  }
#endif
};

// IQ4_XS: 256 weights in 136 bytes: fp16 d, 16 bits of high scale bits (2 per sub-block), 4
// bytes of low scale nibbles, 8 sub-blocks of 16 nibble bytes (Q4_0 order) indexing kIQ4Values;
// w = d * (scale - 32) * value.
struct IQ4_XS {
  static constexpr int kId = kIQ4_XS, kWeights = 256, kBytes = 136, kSubs = 8;
  static constexpr bool kMin = false, kSigned = true, kQ6 = false;
  static int scale(const uint8_t* b, int s) {
    const int lo = (b[4 + s / 2] >> (4 * (s % 2))) & 0x0F;
    const int hi = ((b[2] | (b[3] << 8)) >> (2 * s)) & 3;
    return (lo | (hi << 4)) - 32;
  }
  static void sub(const uint8_t* b, int s, int32_t* c, float* d, float& m) {
    nibbles(b + 8 + 16 * s, c);
    for (int j = 0; j < 32; ++j) c[j] = kIQ4Values[c[j]];
    d[0] = d[1] = half_at(b) * static_cast<float>(scale(b, s));
    m = 0.0f;
  }
#if defined(RADIXLM_Q4_AVX2)
  static constexpr bool kLoadMin = false;
  static void load(const uint8_t* row, int64_t g0, int, Chunk& ch) {
    const uint8_t* b = row + static_cast<uint64_t>(g0) / kSubs * kBytes;
    for (int s = 0; s < 8; ++s) signed_codes(iq4_values(b + 8 + 16 * s), ch, s);
    // scale(b, s) for the 8 sub-blocks at once: s's low nibble is bits 4s..4s+3 of the 4 bytes at
    // b + 4, its high pair bits 2s..2s+1 of the 16 bits at b + 2
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u32_at(b + 4))),
                                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[2] | (b[3] << 8)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    ch.d = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), _mm256_cvtepi32_ps(sc));
  }
#endif
};

#if defined(RADIXLM_Q4_AVX2)
// Sub-block i's products with x (32 int8), summed to 8 int32.
template <class T>
inline __m256i sub_dot(const Chunk& ch, int i, __m256i x) {
  if constexpr (T::kSigned) {
    return dot_us(ch.q[i], _mm256_sign_epi8(x, ch.aux[i]));
  } else if constexpr (T::kQ6) {
    // (q - 32) . x per pair as int16 (|.| <= 2 * 63 * 127 + 2 * 32 * 127 < 2^15), times the scales
    const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(ch.q[i], x), _mm256_maddubs_epi16(_mm256_set1_epi8(32), x));
    return _mm256_madd_epi16(pairs, ch.aux[i]);
  } else {
    return dot_us(ch.q[i], x);
  }
}

// Lane i: the sum of s[i]'s 8 lanes.
inline __m256i sum8x8(const __m256i* s) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The chunk's contribution for R rows of x (sub-blocks g0.. of each, n of them: 8, or fewer at a
// row's end): acc[b] += sum8(dots) * D * dx, macc[b] += M * xsum.
template <class T, int R>
inline void chunk_dots(const Chunk& ch, int n, const int8_t* xq, int64_t k, const float* dx, const float* xsum,
                       int64_t groups, int64_t g0, __m256* acc, __m256* macc) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int b = 0; b < R; ++b) {
    const int8_t* xb = xq + b * k + g0 * kGroup;
    __m256i s[8];
    for (int i = 0; i < 8; ++i) {
      s[i] = i < n ? sub_dot<T>(ch, i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + i * kGroup)))
                   : _mm256_setzero_si256();
    }
    const float* db = dx + b * groups + g0;
    const __m256 dxv = n == 8 ? _mm256_loadu_ps(db) : _mm256_maskload_ps(db, mask);
    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(s)), _mm256_mul_ps(ch.d, dxv), acc[b]);
    if constexpr (T::kLoadMin) {
      const float* sb = xsum + b * groups + g0;
      macc[b] = _mm256_fmadd_ps(ch.m, n == 8 ? _mm256_loadu_ps(sb) : _mm256_maskload_ps(sb, mask), macc[b]);
    }
  }
}
#endif

#if defined(RADIXLM_GGUF_AVX512)
// z[p] holding sub-blocks 2p (lanes 0..7) and 2p + 1 (lanes 8..15) -> lane i: sub-block i's sum
// (sum8x8's result; integer sums, so the order of the additions does not matter).
inline __m256i pair_sums(const __m512i* z) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
  // each 128-bit lane L: the sums of its 4 int32 of z[0], z[1], z[2] and z[3]
  const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  // sub-block 2p: lanes L0 + L1 of z[p]; 2p + 1: L2 + L3
  const __m512i e = _mm512_shuffle_i64x2(c, c, _MM_SHUFFLE(3, 1, 2, 0));  // L0, L2, L1, L3
  const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(e), _mm512_extracti64x4_epi64(e, 1));  // 0 2 4 6 1 3 5 7
  return _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

constexpr int kXRows = q4::kXRows;  // rows of x per pass over a weight row
// Bytes ahead of the chunk being read: one row of x streams a weight row at about 20-30 GB/s a
// thread, so a fetch must start ~100 ns ahead to land in time (one thread, rows of 2048 from DRAM,
// AMD EPYC: 4096 over 1024 gave Q8_0 1.2x, Q6_K 1.06-1.19x, Q4_K 1.05-1.4x).
constexpr int64_t kPrefetch = 4096;

// dot[b] = the weight row's product with x's row b (b < R), from x quantized per 32.
template <class T, int R>
void row_dots(const uint8_t* row, const int8_t* xq, int64_t k, const float* dx, const float* xsum, int64_t groups,
              float* dot) {
#if defined(RADIXLM_GGUF_AVX512)
  if constexpr (R == 1 && T::kQ6) {
    // one row of x against Q6_K blocks, two sub-blocks a 64-byte vector (single-thread from
    // cache, AMD EPYC: 3-6% faster than the 32-byte kernel below); the same sums in the same order
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
      const uint8_t* p = row + static_cast<uint64_t>(g0) / T::kSubs * T::kBytes;
      for (int64_t ahead = 0; ahead < T::kBytes; ahead += 64) __builtin_prefetch(p + kPrefetch + ahead);
      __m512i z[4];
      T::pairs(p, xq + g0 * kGroup, z);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sums(z)), _mm256_mul_ps(_mm256_set1_ps(half_at(p + 208)), _mm256_loadu_ps(dx + g0)), acc);
    }
    dot[0] = hsum(acc);
    return;
  }
#endif
#if defined(RADIXLM_Q4_AVX2)
  __m256 acc[R], macc[R];
  for (int b = 0; b < R; ++b) acc[b] = macc[b] = _mm256_setzero_ps();
  Chunk ch;
  int64_t g0 = 0;
  constexpr int64_t kChunkBytes = 8 / T::kSubs * T::kBytes;
  for (; g0 + 8 <= groups; g0 += 8) {
    const uint8_t* p = row + static_cast<uint64_t>(g0) / T::kSubs * T::kBytes;
    __builtin_prefetch(p + kPrefetch);
    if constexpr (kChunkBytes > 64) __builtin_prefetch(p + kPrefetch + 64);
    if constexpr (kChunkBytes > 128) __builtin_prefetch(p + kPrefetch + 128);
    if constexpr (kChunkBytes > 192) __builtin_prefetch(p + kPrefetch + 192);
    if constexpr (kChunkBytes > 256) __builtin_prefetch(p + kPrefetch + 256);
    T::load(row, g0, 8, ch);
    chunk_dots<T, R>(ch, 8, xq, k, dx, xsum, groups, g0, acc, macc);
  }
  // only blocks of 32 leave a tail (K-quant rows are whole super-blocks): one chunk of fewer than
  // 8, block g0 + i in lane i as in a whole chunk (so every row sums its blocks in one order:
  // lane g % 8, then hsum's tree; the interleaved kernel below keeps that order). Its own Chunk:
  // indexed by a count known only at run time, it lives in memory, and the loop's stays in registers.
  if (g0 < groups) {
    const int n = static_cast<int>(groups - g0);
    Chunk tail;
    T::load(row, g0, n, tail);
    chunk_dots<T, R>(tail, n, xq, k, dx, xsum, groups, g0, acc, macc);
  }
  for (int b = 0; b < R; ++b) {
    if constexpr (T::kLoadMin) {
      dot[b] = hsum(_mm256_add_ps(acc[b], macc[b]));
    } else {
      dot[b] = hsum(acc[b]);
    }
  }
#else
  float acc[R] = {};
  int32_t c[32];
  float d[2], m;
  for (int64_t g = 0; g < groups; ++g) {
    T::sub(row + g / T::kSubs * T::kBytes, static_cast<int>(g % T::kSubs), c, d, m);
    for (int b = 0; b < R; ++b) {
      const int8_t* xb = xq + b * k + g * kGroup;
      int32_t t0 = 0, t1 = 0;
      for (int j = 0; j < 16; ++j) t0 += c[j] * xb[j];
      for (int j = 16; j < 32; ++j) t1 += c[j] * xb[j];
      acc[b] += dx[b * groups + g] * (d[0] * static_cast<float>(t0) + d[1] * static_cast<float>(t1));
      if constexpr (T::kMin) acc[b] += m * xsum[b * groups + g];
    }
  }
  for (int b = 0; b < R; ++b) dot[b] = acc[b];
#endif
}

// ---- Many rows of x: x interleaved, 16 rows a vector (AVX-512 VNNI builds) ----
//
// The kernel above decodes a weight row once per 4 rows of x and sums every chunk across lanes.
// From 6 rows of x (Q8_0), 12 (the other types) or 28 (q4_matmul.h's int4 tiles), a type instead
// multiplies a 16-row vector of x at a time: x's codes are kept interleaved (block g of rows
// 16v..16v+15: 8 steps of 64 bytes, step j holding each row's codes 4j..4j+3, as unsigned bytes
// q + 128), so one vpdpbusd multiplies 4 codes of a weight row (broadcast, signed) with 4 codes
// of each of 16 rows of x. A tile of up to 4 weight rows is first decoded once into signed bytes
// (Q8_0's are the file's own), with each block's scale D and minimum M; then it is multiplied
// with 2 such vectors side by side: each weight dword is read once per vector pair, each x step
// once per weight row of the tile, and nothing is summed across lanes. The offset of x's codes
// adds 128 * (the block's code sum) to each dot product, subtracted exactly (the accumulator
// starts at minus that). Q6_K's two scales of 16 multiply the two halves' integer sums, as its
// row kernel's int16 products do.
//
// A row of x gets the same sums in the same order as from row_dots (so its output does not
// depend on the batch it came in): block g's exact integer dot product s_g, then
// a[g % 8] = fma(s_g, D_g * dx_g, a[g % 8]) and m[g % 8] = fma(M_g, xsum_g, m[g % 8]) in
// increasing g, then hsum's tree over a[i] + m[i].

#if defined(RADIXLM_GGUF_AVX512)
#define RADIXLM_GGUF_LANES 1
#endif

constexpr int64_t kLaneRows = 16;  // rows of x per interleaved vector
constexpr int64_t kLaneBlockBytes = kLaneRows * kGroup;  // one block of a vector's 16 rows
constexpr int64_t kLanesMinRows = 6;  // rows of x from which x is also kept interleaved (and Q8_0 uses it)
// Rows of x from which the other types (and the int4 tiles) take the interleaved kernel: their
// codes are decoded once per 4 weight rows, which pays from about 12 rows of x (single-thread,
// 2048 x 2048, AVX-512 VNNI EPYC: 0.7-0.9x the row kernel's speed at 8 rows, 0.9-1.4x at 12,
// 1.7-3.0x at 32); Q8_0's are read in place.
constexpr int64_t kDecodedLanesMinRows = 12;
// The int4 tiles' row kernel (q4_matmul.h) reads 4 weight rows in one stream and stays ahead of
// the interleaved one below 28 rows of x (0.93x at 24, 1.2x at 32, 1.4x at 64, same machine).
constexpr int64_t kTileLanesMinRows = 28;

// Whether x of ``rows`` rows is also kept interleaved.
inline bool lanes_layout(int64_t rows) {
#if defined(RADIXLM_GGUF_LANES)
  return rows >= kLanesMinRows;
#else
  (void)rows;
  return false;
#endif
}

inline int64_t lane_vectors(int64_t rows) { return (rows + kLaneRows - 1) / kLaneRows; }

// Bytes of scratch that ``rows`` rows of ``k`` take: q4::scratch_bytes' layout, then (from the
// next 64-byte boundary) the interleaved codes, their scales and their sums where lanes_layout
// says so.
inline int64_t scratch_bytes(int64_t rows, int64_t k) {
  int64_t bytes = q4::scratch_bytes(rows, k);
  if (lanes_layout(rows)) bytes += 64 + lane_vectors(rows) * (k / kGroup) * (kLaneBlockBytes + 2 * kLaneRows * 4);
  return bytes;
}

// The interleaved codes (then their scales and sums, each [vector][block][16] floats) in scratch.
inline uint8_t* lanes_data(const uint8_t* scratch, int64_t rows, int64_t k) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(scratch) + static_cast<uintptr_t>(q4::scratch_bytes(rows, k));
  return reinterpret_cast<uint8_t*>((end + 63) & ~static_cast<uintptr_t>(63));
}

// x [rows, k] quantized into ``scratch`` (scratch_bytes(rows, k) bytes): q4::quantize_into's
// codes, scales and sums, and their interleaved copy where lanes_layout says so (rows past the
// last ones: codes 0, scale 0, sum 0).
inline void quantize_into(const float* x, int64_t rows, int64_t k, uint8_t* scratch) {
  q4::quantize_into(x, rows, k, scratch);
  if (!lanes_layout(rows)) return;
  const int64_t groups = k / kGroup, vectors = lane_vectors(rows);
  const float* dx = reinterpret_cast<const float*>(scratch);
  const float* xsum = dx + rows * groups;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(xsum + rows * groups);
  uint8_t* xi = lanes_data(scratch, rows, k);
  float* dxi = reinterpret_cast<float*>(xi + vectors * groups * kLaneBlockBytes);
  float* xsi = dxi + vectors * groups * kLaneRows;
  for (int64_t v = 0; v < vectors; ++v) {
    for (int64_t lane = 0; lane < kLaneRows; ++lane) {
      const int64_t b = v * kLaneRows + lane;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* out = xi + (v * groups + g) * kLaneBlockBytes + lane * 4;
        const int64_t at = (v * groups + g) * kLaneRows + lane;
        if (b < rows) {
          const uint8_t* src = xq + b * k + g * kGroup;
          for (int j = 0; j < 8; ++j) {
            uint32_t c;
            std::memcpy(&c, src + 4 * j, 4);
            c ^= 0x80808080u;  // q + 128 as unsigned bytes
            std::memcpy(out + j * 64, &c, 4);
          }
          dxi[at] = dx[b * groups + g];
          xsi[at] = xsum[b * groups + g];
        } else {
          for (int j = 0; j < 8; ++j) std::memset(out + j * 64, 0x80, 4);
          dxi[at] = xsi[at] = 0.0f;
        }
      }
    }
  }
}

#if defined(RADIXLM_GGUF_LANES)
// A tile of up to 4 weight rows as the interleaved kernel multiplies them: block g of row r's 32
// signed codes at codes[r] + g * (32, or Q8_0's block bytes: its codes are read in place);
// corr[r][g * H + h] = -128 * (the sum of half h's codes), with H = 2 halves of 16 for Q6_K
// (sc[r][2 g + h]: their scales, as floats), else 1; d[r][g] = D and, for types with a minimum,
// m[r][g] = M.
struct LaneTile {
  const int8_t* codes[4];
  std::vector<int8_t> decoded;
  std::vector<int32_t> corr;
  std::vector<float> sc, d, m;
  explicit LaneTile(int64_t groups)
      : decoded(4 * groups * kGroup), corr(8 * groups), sc(8 * groups), d(4 * groups), m(4 * groups) {}
};

// For Q8_0 rows: their codes read in place, corr = -128 * (block g's code sum), d = its scale.
inline void q8_row_sums(const uint8_t* row, int64_t groups, int64_t ahead, int32_t* corr, float* dw) {
  const __m256i ones = _mm256_set1_epi8(1);
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint8_t* b = row + g * Q8_0::kBytes;
    __builtin_prefetch(b + ahead);
    __builtin_prefetch(b + ahead + 64);
    __builtin_prefetch(b + ahead + 128);
    __builtin_prefetch(b + ahead + 192);
    __builtin_prefetch(b + ahead + 256);
    __m256i s[8];
    for (int i = 0; i < 8; ++i) {
      s[i] = dot_us(ones, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * Q8_0::kBytes + 2)));
    }
    const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum8x8(s), 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + g), c);
    _mm256_storeu_ps(dw + g, halves8(b, Q8_0::kBytes, 8));
  }
  for (; g < groups; ++g) {
    const uint8_t* b = row + g * Q8_0::kBytes;
    int32_t t = 0;
    for (int j = 0; j < 32; ++j) t += static_cast<int8_t>(b[2 + j]);
    corr[g] = -128 * t;
    dw[g] = half_at(b);
  }
}

// The sums of 32 signed codes' two halves (elements 0..15 and 16..31).
inline void half_sums(__m256i c, int32_t& lo, int32_t& hi) {
  alignas(32) int32_t s[8];  // lane l: the sum of codes 4l..4l+3
  const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), c);
  _mm256_store_si256(reinterpret_cast<__m256i*>(s), sums);
  lo = s[0] + s[1] + s[2] + s[3];
  hi = s[4] + s[5] + s[6] + s[7];
}

// A weight row of T's blocks decoded into signed codes, corrections, scales and minimums.
template <class T>
inline void lane_decode(const uint8_t* row, int64_t groups, int8_t* codes, int32_t* corr, float* sc, float* d,
                        float* m) {
  Chunk ch;
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, groups - g0));
    __builtin_prefetch(row + static_cast<uint64_t>(g0 + 8) / T::kSubs * T::kBytes + kPrefetch);
    T::load(row, g0, n, ch);
    alignas(32) float dd[8], mm[8];
    _mm256_store_ps(dd, ch.d);
    if constexpr (T::kLoadMin) _mm256_store_ps(mm, ch.m);
    for (int i = 0; i < n; ++i) {
      const int64_t g = g0 + i;
      __m256i c;
      if constexpr (T::kSigned) {
        c = ch.aux[i];  // the signed codes themselves
      } else if constexpr (T::kQ6) {
        c = _mm256_sub_epi8(ch.q[i], _mm256_set1_epi8(32));
      } else {
        c = ch.q[i];  // unsigned codes, at most 31
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * kGroup), c);
      int32_t lo, hi;
      half_sums(c, lo, hi);
      if constexpr (T::kQ6) {
        corr[2 * g] = -128 * lo;
        corr[2 * g + 1] = -128 * hi;
        sc[2 * g] = static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(ch.aux[i], 0)));
        sc[2 * g + 1] = static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(ch.aux[i], 8)));
      } else {
        corr[g] = -128 * (lo + hi);
      }
      d[g] = dd[i];
      if constexpr (T::kLoadMin) m[g] = mm[i];
    }
  }
}

// out[(r * P + p) * 16 + lane] = weight row r's product with row 16 (v0 + p) + lane of x; kMin:
// the blocks have minimums, kHalves: Q6_K's two scaled halves; kSplit: 8 partial sums (block g
// in sum g % 8, then hsum's tree: row_dots' order), or 1 (blocks in turn: the int4 tiles' order).
// Kept out of line: inlined into its caller, GCC reloaded x's vectors for every weight row (Q8_0
// at 32 rows: 9-12% slower).
template <bool kMin, bool kHalves, int64_t kStride, int kSplit, int R, int P>
__attribute__((noinline)) void lanes_tile(const LaneTile& t, int64_t groups, const uint8_t* xi, const float* dxi,
                                          const float* xsi, int64_t v0, float* out) {
  constexpr int H = kHalves ? 2 : 1;
  const int32_t* corr = t.corr.data();
  const float* dw = t.d.data();
  const float* mw = t.m.data();
  const float* scw = t.sc.data();
  const int8_t* codes[R];
  for (int r = 0; r < R; ++r) codes[r] = t.codes[r];
  alignas(64) float part[kSplit][R][P][kLaneRows];
  for (int i = 0; i < kSplit; ++i) {
    __m512 acc[R][P], macc[R][P];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) acc[r][p] = macc[r][p] = _mm512_setzero_ps();
    }
    for (int64_t g = i; g < groups; g += kSplit) {
      __m512i s[R][P];
      __m512 half[R][P];
      const uint8_t* wq[R];
      for (int r = 0; r < R; ++r) {
        wq[r] = reinterpret_cast<const uint8_t*>(codes[r] + g * kStride);
        const __m512i c = _mm512_set1_epi32(corr[(r * groups + g) * H]);
        for (int p = 0; p < P; ++p) s[r][p] = c;
      }
      const uint8_t* xg[P];
      for (int p = 0; p < P; ++p) xg[p] = xi + ((v0 + p) * groups + g) * kLaneBlockBytes;
      for (int j = 0; j < 8; ++j) {
        if constexpr (kHalves) {
          if (j == 4) {  // elements 0..15 done: scale them, start 16..31
            for (int r = 0; r < R; ++r) {
              const __m512 sc = _mm512_set1_ps(scw[(r * groups + g) * 2]);
              const __m512i c = _mm512_set1_epi32(corr[(r * groups + g) * 2 + 1]);
              for (int p = 0; p < P; ++p) {
                half[r][p] = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][p]), sc);
                s[r][p] = c;
              }
            }
          }
        }
        __m512i xv[P];
        for (int p = 0; p < P; ++p) xv[p] = _mm512_load_si512(reinterpret_cast<const void*>(xg[p] + j * 64));
        for (int r = 0; r < R; ++r) {
          const __m512i wv = _mm512_set1_epi32(static_cast<int>(u32_at(wq[r] + 4 * j)));
          for (int p = 0; p < P; ++p) s[r][p] = _mm512_dpbusd_epi32(s[r][p], xv[p], wv);
        }
      }
      for (int p = 0; p < P; ++p) {
        const int64_t at = ((v0 + p) * groups + g) * kLaneRows;
        const __m512 dxv = _mm512_load_ps(dxi + at);
        for (int r = 0; r < R; ++r) {
          __m512 sum;
          if constexpr (kHalves) {
            // sc0 * s0 + sc1 * s1 in floats: every product and the sum are integers below 2^24: exact
            const __m512 sc = _mm512_set1_ps(scw[(r * groups + g) * 2 + 1]);
            sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][p]), sc, half[r][p]);
          } else {
            sum = _mm512_cvtepi32_ps(s[r][p]);
          }
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dw[r * groups + g]), dxv);
          acc[r][p] = _mm512_fmadd_ps(sum, scale, acc[r][p]);
        }
        if constexpr (kMin) {
          const __m512 xsv = _mm512_load_ps(xsi + at);
          for (int r = 0; r < R; ++r) macc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(mw[r * groups + g]), xsv, macc[r][p]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        _mm512_store_ps(part[i][r][p], kMin ? _mm512_add_ps(acc[r][p], macc[r][p]) : acc[r][p]);
      }
    }
  }
  if constexpr (kSplit == 1) {
    std::memcpy(out, part, sizeof(part));
    return;
  }
  // hsum's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      __m512 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm512_load_ps(part[i][r][p]);
      const __m512 even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
      const __m512 odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
      _mm512_storeu_ps(out + (r * P + p) * kLaneRows, _mm512_add_ps(even, odd));
    }
  }
}

template <bool kMin, bool kHalves, int64_t kStride, int kSplit, int P>
inline void lanes_tile_rows(int nr, const LaneTile& t, int64_t groups, const uint8_t* xi, const float* dxi,
                            const float* xsi, int64_t v0, float* out) {
  switch (nr) {
    case 1: lanes_tile<kMin, kHalves, kStride, kSplit, 1, P>(t, groups, xi, dxi, xsi, v0, out); break;
    case 2: lanes_tile<kMin, kHalves, kStride, kSplit, 2, P>(t, groups, xi, dxi, xsi, v0, out); break;
    case 3: lanes_tile<kMin, kHalves, kStride, kSplit, 3, P>(t, groups, xi, dxi, xsi, v0, out); break;
    default: lanes_tile<kMin, kHalves, kStride, kSplit, 4, P>(t, groups, xi, dxi, xsi, v0, out); break;
  }
}

// y[b * ldy + r] for weight rows r in [begin, end) and every row b of x, from x's interleaved
// copy in ``scratch``; prepare(r0, nr, tile) fills ``tile`` with weight rows r0..r0+nr-1.
template <bool kMin, bool kHalves, int64_t kStride, int kSplit, class Prepare>
inline void lanes_matmul(int64_t begin, int64_t end, const uint8_t* scratch, int64_t rows, int64_t k, float* y,
                         int64_t ldy, Prepare&& prepare) {
  constexpr int kR = 4, kP = 2;
  const int64_t groups = k / kGroup, vectors = lane_vectors(rows);
  const uint8_t* xi = lanes_data(scratch, rows, k);
  const float* dxi = reinterpret_cast<const float*>(xi + vectors * groups * kLaneBlockBytes);
  const float* xsi = dxi + vectors * groups * kLaneRows;
  // x's vectors in panels that stay in L2 (~256 KB) while every weight row of the range passes
  int64_t panel = std::max<int64_t>(1, (256 << 10) / (kLaneBlockBytes * groups));
  if (panel > 1) panel -= panel % kP;
  LaneTile tile(groups);
  alignas(64) float out[kR * kP * kLaneRows];
  for (int64_t v0 = 0; v0 < vectors; v0 += panel) {
    const int64_t v1 = std::min(vectors, v0 + panel);
    for (int64_t r0 = begin; r0 < end; r0 += kR) {
      const int nr = static_cast<int>(std::min<int64_t>(kR, end - r0));
      prepare(r0, nr, tile);
      for (int64_t v = v0; v < v1; v += kP) {
        const int np = static_cast<int>(std::min<int64_t>(kP, v1 - v));
        if (np == 2) {
          lanes_tile_rows<kMin, kHalves, kStride, kSplit, 2>(nr, tile, groups, xi, dxi, xsi, v, out);
        } else {
          lanes_tile_rows<kMin, kHalves, kStride, kSplit, 1>(nr, tile, groups, xi, dxi, xsi, v, out);
        }
        for (int r = 0; r < nr; ++r) {
          for (int p = 0; p < np; ++p) {
            for (int64_t lane = 0; lane < kLaneRows; ++lane) {
              const int64_t b = (v + p) * kLaneRows + lane;
              if (b < rows) y[b * ldy + r0 + r] = out[(r * np + p) * kLaneRows + lane];
            }
          }
        }
      }
    }
  }
}

// matmul_rows_t from x's interleaved copy.
template <class T>
inline void matmul_lanes(const uint8_t* w, int64_t begin, int64_t end, const uint8_t* scratch, int64_t rows, int64_t k,
                         float* y, int64_t ldy) {
  constexpr bool kHalves = T::kQ6;
  constexpr int64_t kStride = T::kId == kQ8_0 ? Q8_0::kBytes : kGroup;  // Q8_0's codes are read in place
  const int64_t groups = k / kGroup, row_bytes = k / T::kWeights * T::kBytes;
  const auto prepare = [&](int64_t r0, int nr, LaneTile& tile) {
    for (int r = 0; r < nr; ++r) {
      const uint8_t* row = w + (r0 + r) * row_bytes;
      if constexpr (T::kId == kQ8_0) {
        tile.codes[r] = reinterpret_cast<const int8_t*>(row + 2);
        q8_row_sums(row, groups, 4 * row_bytes, tile.corr.data() + r * groups, tile.d.data() + r * groups);
      } else {
        int8_t* codes = tile.decoded.data() + r * groups * kGroup;
        tile.codes[r] = codes;
        lane_decode<T>(row, groups, codes, tile.corr.data() + r * groups * (kHalves ? 2 : 1),
                       tile.sc.data() + r * groups * 2, tile.d.data() + r * groups, tile.m.data() + r * groups);
      }
    }
  };
  lanes_matmul<T::kLoadMin, kHalves, kStride, 8>(begin, end, scratch, rows, k, y, ldy, prepare);
}

// q4::matmul_tiles from x's interleaved copy (x quantized by quantize_into above): each tile's 4
// rows decoded to codes 0..15 with their d and m (Q4_0: -8 d, as tile_dots computes it), summed
// block after block as tile_dots sums them, so a row's output does not depend on its batch.
inline void matmul_tiles_lanes(const uint8_t* tiles, const uint8_t* scratch, int64_t rows, int64_t k, int64_t n,
                               int64_t tile_begin, int64_t tile_end, float* y, bool q4_0) {
  const int64_t groups = k / kGroup;
  const int64_t block_bytes = q4_0 ? q4::kQ4_0TileBlockBytes : q4::kTileBlockBytes, codes_at = q4_0 ? 8 : 16;
  const auto prepare = [&](int64_t r0, int nr, LaneTile& tile) {
    const uint8_t* base = tiles + r0 / q4::kTile * groups * block_bytes;
    for (int r = 0; r < nr; ++r) tile.codes[r] = tile.decoded.data() + r * groups * kGroup;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* tb = base + g * block_bytes;
      __builtin_prefetch(tb + q4::kPrefetch);
      for (int r = 0; r < nr; ++r) {
        const __m256i c = nibbles32(tb + codes_at + 16 * r);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile.decoded.data() + (r * groups + g) * kGroup), c);
        int32_t lo, hi;
        half_sums(c, lo, hi);
        tile.corr[r * groups + g] = -128 * (lo + hi);
        const float d = half_at(tb + 2 * r);
        tile.d[r * groups + g] = d;
        tile.m[r * groups + g] = q4_0 ? d * -8.0f : half_at(tb + 8 + 2 * r);
      }
    }
  };
  const int64_t begin = tile_begin * q4::kTile, end = std::min(n, tile_end * q4::kTile);
  lanes_matmul<true, false, kGroup, 1>(begin, end, scratch, rows, k, y, n, prepare);
}
#endif

// y[b * ldy + r] for weight rows r in [begin, end) of ``w`` (rows of T's blocks) and every row
// b of x, from x quantized into ``scratch`` by quantize_into above (not q4's: many rows of x are
// read from the interleaved copy).
template <class T>
void matmul_rows_t(const uint8_t* w, int64_t begin, int64_t end, const uint8_t* scratch, int64_t rows, int64_t k,
                   float* y, int64_t ldy) {
#if defined(RADIXLM_GGUF_LANES)
  if (lanes_layout(rows) && (T::kId == kQ8_0 || rows >= kDecodedLanesMinRows)) {
    matmul_lanes<T>(w, begin, end, scratch, rows, k, y, ldy);
    return;
  }
#endif
  const int64_t groups = k / kGroup, row_bytes = k / T::kWeights * T::kBytes;
  const float* dx = reinterpret_cast<const float*>(scratch);
  const float* xsum = dx + rows * groups;
  const int8_t* xq = reinterpret_cast<const int8_t*>(xsum + rows * groups);
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t b0 = 0; b0 < rows; b0 += kXRows) {
      const int64_t n = std::min<int64_t>(kXRows, rows - b0);
      float dot[kXRows];
      const int8_t* qb = xq + b0 * k;
      const float* db = dx + b0 * groups;
      const float* sb = xsum + b0 * groups;
      switch (n) {
        case 1: row_dots<T, 1>(row, qb, k, db, sb, groups, dot); break;
#if defined(__AVX512VL__)
        case 2: row_dots<T, 2>(row, qb, k, db, sb, groups, dot); break;
        case 3: row_dots<T, 3>(row, qb, k, db, sb, groups, dot); break;
        default: row_dots<T, 4>(row, qb, k, db, sb, groups, dot); break;
#else
        default: row_dots<T, 2>(row, qb, k, db, sb, groups, dot); break;
#endif
      }
      for (int64_t b = 0; b < n; ++b) y[(b0 + b) * ldy + r] = dot[b];
    }
  }
}

// One block dequantized to float32 exactly as GGUF's dequantize computes it.
template <class T>
void dequantize_block(const uint8_t* b, float* out) {
  int32_t c[32];
  float d[2], m;
  for (int s = 0; s < T::kSubs; ++s) {
    T::sub(b, s, c, d, m);
    float* o = out + s * kGroup;
    for (int j = 0; j < 32; ++j) {
      if constexpr (T::kMin) {
        volatile float p = d[j / 16] * static_cast<float>(c[j]);  // rounded, then added: never fused into an FMA
        o[j] = p + m;
      } else {
        o[j] = d[j / 16] * static_cast<float>(c[j]);
      }
    }
  }
}

// Calls f(T{}) with the type struct of ``type``; returns false for an unsupported type.
template <class F>
bool dispatch(int type, F&& f) {
  switch (type) {
    case kQ4_0: f(Q4_0{}); return true;
    case kQ4_1: f(Q4_1{}); return true;
    case kQ5_0: f(Q5_0{}); return true;
    case kQ5_1: f(Q5_1{}); return true;
    case kQ8_0: f(Q8_0{}); return true;
    case kQ4_K: f(Q4_K{}); return true;
    case kQ5_K: f(Q5_K{}); return true;
    case kQ6_K: f(Q6_K{}); return true;
    case kIQ4_NL: f(IQ4_NL{}); return true;
    case kIQ4_XS: f(IQ4_XS{}); return true;
    case kMXFP4: f(MXFP4{}); return true;
    case kQ4_Z: f(Q4_Z{}); return true;
    default: return false;
  }
}

inline bool supported(int type) {
  return dispatch(type, [](auto) {});
}

// (weights, bytes) of one block of ``type``; (0, 0) when unsupported.
inline void block_shape(int type, int64_t& weights, int64_t& bytes) {
  weights = bytes = 0;
  dispatch(type, [&](auto t) {
    weights = decltype(t)::kWeights;
    bytes = decltype(t)::kBytes;
  });
}

// y[b * ldy + r] = x_b . W_r for rows r in [begin, end) of w (``type`` blocks, k per row).
inline void matmul_rows(int type, const uint8_t* w, int64_t begin, int64_t end, const uint8_t* scratch, int64_t rows,
                        int64_t k, float* y, int64_t ldy) {
  dispatch(type, [&](auto t) { matmul_rows_t<decltype(t)>(w, begin, end, scratch, rows, k, y, ldy); });
}

// A row of k weights (``type`` blocks) dequantized into out[k].
inline void dequantize_row(int type, const uint8_t* row, int64_t k, float* out) {
  dispatch(type, [&](auto t) {
    using T = decltype(t);
    for (int64_t i = 0; i < k / T::kWeights; ++i) dequantize_block<T>(row + i * T::kBytes, out + i * T::kWeights);
  });
}

}  // namespace radixlm::gguf
