/* Fused elementwise kernels for the CPU decode path (cbgen/model/fused_decode.py).
 *
 * Why: an eager decode step of a small model is dominated by ~50 tiny torch ops per layer (the
 * RMSNorm alone is six), each paying dispatch, allocation and a pass over memory.  These kernels do
 * residual-add + RMSNorm, rotary embedding of q and k, and SiLU(gate) * up in one pass each.
 *
 * Numerics follow the transformers modules they replace: statistics in float32, and for bfloat16
 * every value the module would store in bfloat16 is rounded there too (the residual sum, the
 * normalised activations before the weight, the activation before the product).
 *
 * Layouts are row-major with explicit row strides in elements.  dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ld(const void *p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    uint32_t bits = ((uint32_t)((const uint16_t *)p)[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The value a bfloat16 tensor would hold (identity for float32). */
static inline float rnd(float f, int dtype) {
    if (dtype == 0) return f;
    uint32_t bits = ((uint32_t)to_bf16(f)) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

static inline void st(void *p, int64_t i, float f, int dtype) {
    if (dtype == 0)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = to_bf16(f);
}

/* exp(x) in a form loops vectorise (libm's expf stays scalar without -ffast-math): 2^k * 2^f,
 * k = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor series (relative error ~1e-7).
 * Saturates to 0 below -87 and to ~2^128 (inf after the final multiply) above 88. */
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

/* Parallel only when the work pays for waking the other threads. */
#define BIG(work) ((work) >= 65536)

/* For each of `rows` rows of n values: x += delta (when delta is not NULL, stored back into x),
 * then out = weight * rmsnorm(x).  out may alias x. */
static inline __attribute__((always_inline)) void add_rmsnorm_impl(void *x, const void *delta, const void *weight,
                                                                   void *out, int64_t rows, int64_t n,
                                                                   int64_t x_stride, int64_t delta_stride,
                                                                   int64_t out_stride, float eps, const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t xo = r * x_stride, oo = r * out_stride;
        float ss = 0.0f;
        if (delta) {
            const int64_t dl = r * delta_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                float v = rnd(ld(x, xo + i, dtype) + ld(delta, dl + i, dtype), dtype);
                st(x, xo + i, v, dtype);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                float v = ld(x, xo + i, dtype);
                ss += v * v;
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            float v = rnd(ld(x, xo + i, dtype) * inv, dtype);
            st(out, oo + i, rnd(ld(weight, i, dtype) * v, dtype), dtype);
        }
    }
}

/* Each public kernel is compiled once per dtype, so its loops see a constant dtype and vectorise. */
int cbgen_add_rmsnorm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t n,
                      int64_t x_stride, int64_t delta_stride, int64_t out_stride, float eps, int dtype) {
    if (dtype == 0)
        add_rmsnorm_impl(x, delta, weight, out, rows, n, x_stride, delta_stride, out_stride, eps, 0);
    else
        add_rmsnorm_impl(x, delta, weight, out, rows, n, x_stride, delta_stride, out_stride, eps, 1);
    return 0;
}

/* transformers' rotate-half rotary embedding, in place, on q [T, H, D] and k [T, Hk, D] (row
 * strides q_stride / k_stride between tokens, heads contiguous), with cos/sin [T, D] of the same
 * dtype.  out[i] = x[i] cos[i] - x[i + D/2] sin[i] for i < D/2, x[i] cos[i] + x[i - D/2] sin[i] after. */
static inline __attribute__((always_inline)) void rope_impl(void *q, void *k, const void *cos, const void *sin,
                                                            int64_t T, int H, int Hk, int D, int64_t q_stride,
                                                            int64_t k_stride, const int dtype) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (BIG(T * (H + Hk) * (int64_t)D))
    for (int64_t t = 0; t < T; ++t) {
        float c[512], s[512];
        for (int i = 0; i < D; ++i) {
            c[i] = ld(cos, t * D + i, dtype);
            s[i] = ld(sin, t * D + i, dtype);
        }
        for (int h = 0; h < H + Hk; ++h) {
            void *base = h < H ? q : k;
            const int64_t off = h < H ? t * q_stride + (int64_t)h * D : t * k_stride + (int64_t)(h - H) * D;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                float a = ld(base, off + i, dtype), b = ld(base, off + i + half, dtype);
                st(base, off + i, a * c[i] - b * s[i], dtype);
                st(base, off + i + half, b * c[i + half] + a * s[i + half], dtype);
            }
        }
    }
}

int cbgen_rope(void *q, void *k, const void *cos, const void *sin, int64_t T, int H, int Hk, int D,
               int64_t q_stride, int64_t k_stride, int dtype) {
    if (dtype == 0)
        rope_impl(q, k, cos, sin, T, H, Hk, D, q_stride, k_stride, 0);
    else
        rope_impl(q, k, cos, sin, T, H, Hk, D, q_stride, k_stride, 1);
    return 0;
}

/* out = silu(gate) * up for `rows` rows of n values. */
static inline __attribute__((always_inline)) void silu_mul_impl(const void *gate, const void *up, void *out,
                                                                int64_t rows, int64_t n, int64_t gate_stride,
                                                                int64_t up_stride, int64_t out_stride,
                                                                const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            float g = ld(gate, r * gate_stride + i, dtype);
            float a = rnd(g / (1.0f + exp_approx(-g)), dtype);
            st(out, r * out_stride + i, a * ld(up, r * up_stride + i, dtype), dtype);
        }
    }
}

int cbgen_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t n, int64_t gate_stride,
                   int64_t up_stride, int64_t out_stride, int dtype) {
    if (dtype == 0)
        silu_mul_impl(gate, up, out, rows, n, gate_stride, up_stride, out_stride, 0);
    else
        silu_mul_impl(gate, up, out, rows, n, gate_stride, up_stride, out_stride, 1);
    return 0;
}
