/* Numerics shared by cbgen's CPU kernels: bfloat16 conversion as torch does it, and an exp that
 * loops vectorise (libm's expf stays scalar without -ffast-math), in scalar, AVX2 and AVX-512 forms. */
#ifndef CBGEN_NUMERICS_H
#define CBGEN_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* exp(x) as 2^k * 2^f, k = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor series (relative
 * error ~1e-7, float32's own precision).  Saturates to ~1e-38 below -87 and to inf above 88. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float k = nearbyintf(t);
    const float f = (t - k) * 0.69314718055994531f;
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const int32_t kk = (int32_t)k;
    /* two factors, so k = 128 (x near 88) does not overflow the exponent field */
    const uint32_t b1 = (uint32_t)(kk / 2 + 127) << 23, b2 = (uint32_t)(kk - kk / 2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return p * s1 * s2;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 elements as float32 (bfloat16 widened by a shift: AVX512F only).  dtype 0 = float32, 1 = bf16. */
static inline __attribute__((always_inline)) __m512 ld16(const void *base, int64_t off, const int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + off);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16 bits, round to nearest even, NaN kept quiet (as f32_to_bf16), in the low 16 bits. */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

/* exp_approx on 16 lanes, 2^k applied with scalef. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 elements as float32 (bfloat16 widened by a shift).  dtype 0 = float32, 1 = bf16. */
static inline __attribute__((always_inline)) __m256 ld8(const void *base, int64_t off, const int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + off);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16 bits (as f32_to_bf16: nearest even, NaN kept quiet), in the low 16 bits. */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* Stores 8 bfloat16 bit patterns (one per 32-bit lane, each <= 0xffff: the unsigned pack is exact). */
static inline __attribute__((always_inline)) void store_bf16x8(uint16_t *p, __m256i bits) {
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

/* exp_approx on 8 lanes; 2^k built in the exponent field (k stays within [-126, 127] after the clamp). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, k), _mm256_set1_ps(0.69314718055994531f));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
