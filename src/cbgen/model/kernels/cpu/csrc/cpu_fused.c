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
#include <stdlib.h>
#include <string.h>

#include "cbgen_numerics.h"

static inline float ld(const void *p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    uint32_t bits = ((uint32_t)((const uint16_t *)p)[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The value a bfloat16 tensor would hold (identity for float32). */
static inline float rnd(float f, int dtype) {
    if (dtype == 0) return f;
    uint32_t bits = ((uint32_t)f32_to_bf16(f)) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

static inline void st(void *p, int64_t i, float f, int dtype) {
    if (dtype == 0)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(f);
}

/* Parallel only when the work pays for waking the other threads.  On a Zen 4 (2 threads) the
 * residual add + RMSNorm of 64 bf16 rows of 576 took 21 us on one thread and 13 on two, the rotary
 * embedding 16 and 11 (threshold 65536 before; one row stays on one thread). */
#define BIG(work) ((work) >= 8192)

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

#if defined(__AVX512F__)
#include <immintrin.h>

/* The value a bfloat16 tensor would hold (identity for float32). */
static inline __attribute__((always_inline)) __m512 rnd16(__m512 v, const int dtype) {
    if (dtype == 0) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}

static inline __attribute__((always_inline)) void st16(void *p, int64_t i, __m512 v, const int dtype) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)p + i, v);
    } else {
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bf16_bits16(v)));
    }
}

/* AVX-512 versions for rows whose length is a multiple of 16; same rounding steps as above. */
static inline __attribute__((always_inline)) void add_rmsnorm16(void *x, const void *delta, const void *weight,
                                                                void *out, int64_t rows, int64_t n,
                                                                int64_t x_stride, int64_t delta_stride,
                                                                int64_t out_stride, float eps, const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t xo = r * x_stride, oo = r * out_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = ld16(x, xo + i, dtype);
            if (delta) {
                v = rnd16(_mm512_add_ps(v, ld16(delta, r * delta_stride + i, dtype)), dtype);
                st16(x, xo + i, v, dtype);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 v = rnd16(_mm512_mul_ps(ld16(x, xo + i, dtype), inv), dtype);
            st16(out, oo + i, _mm512_mul_ps(ld16(weight, i, dtype), v), dtype);
        }
    }
}

static inline __attribute__((always_inline)) void silu_mul16(const void *gate, const void *up, void *out,
                                                             int64_t rows, int64_t n, int64_t gate_stride,
                                                             int64_t up_stride, int64_t out_stride, const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 g = ld16(gate, r * gate_stride + i, dtype);
            const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            const __m512 a = rnd16(_mm512_div_ps(g, den), dtype);
            st16(out, r * out_stride + i, _mm512_mul_ps(a, ld16(up, r * up_stride + i, dtype)), dtype);
        }
    }
}
#define CB_FAST(n) ((n) % 16 == 0)
#else
#define CB_FAST(n) 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 versions for rows whose length is a multiple of 8 (CPUs without AVX-512; on an AMD EPYC with
 * AVX2 only the portable loops did not vectorise and cost ~30 ms of a 64-row float32 decode step of
 * SmolLM2).  Same rounding steps as the portable loops. */
#define CB_FAST8(n) ((n) % 8 == 0)

static inline __attribute__((always_inline)) __m256 rnd8(__m256 v, const int dtype) {
    if (dtype == 0) return v;
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

static inline __attribute__((always_inline)) void st8(void *p, int64_t i, __m256 v, const int dtype) {
    if (dtype == 0) {
        _mm256_storeu_ps((float *)p + i, v);
    } else {
        store_bf16x8((uint16_t *)p + i, bf16_bits8(v));
    }
}

/* st8 for a vector whose lanes already hold bfloat16 values (rnd8's output): the narrowing is exact,
 * so a shift and pack instead of rounding again. */
static inline __attribute__((always_inline)) void st8_exact(void *p, int64_t i, __m256 v, const int dtype) {
    if (dtype == 0) {
        _mm256_storeu_ps((float *)p + i, v);
    } else {
        store_bf16x8((uint16_t *)p + i, _mm256_srli_epi32(_mm256_castps_si256(v), 16));
    }
}

static inline float hsum8f(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline __attribute__((always_inline)) void add_rmsnorm8(void *x, const void *delta, const void *weight,
                                                               void *out, int64_t rows, int64_t n,
                                                               int64_t x_stride, int64_t delta_stride,
                                                               int64_t out_stride, float eps, const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t xo = r * x_stride, oo = r * out_stride;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = ld8(x, xo + i, dtype);
            if (delta) {
                v = rnd8(_mm256_add_ps(v, ld8(delta, r * delta_stride + i, dtype)), dtype);
                st8_exact(x, xo + i, v, dtype);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8f(ss) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 v = rnd8(_mm256_mul_ps(ld8(x, xo + i, dtype), inv), dtype);
            st8(out, oo + i, _mm256_mul_ps(ld8(weight, i, dtype), v), dtype);
        }
    }
}

static inline __attribute__((always_inline)) void silu_mul8(const void *gate, const void *up, void *out,
                                                            int64_t rows, int64_t n, int64_t gate_stride,
                                                            int64_t up_stride, int64_t out_stride, const int dtype) {
#pragma omp parallel for schedule(static) if (BIG(rows * n))
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 g = ld8(gate, r * gate_stride + i, dtype);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
            const __m256 a = rnd8(_mm256_div_ps(g, den), dtype);
            st8(out, r * out_stride + i, _mm256_mul_ps(a, ld8(up, r * up_stride + i, dtype)), dtype);
        }
    }
}

/* One head's rotation, 8 lanes at a time (half % 8 == 0); products and the sum rounded apart. */
static inline __attribute__((always_inline)) void rope_head8(void *base, int64_t off, const void *cos,
                                                             const void *sin, int64_t co, int half,
                                                             const int dtype) {
    for (int i = 0; i < half; i += 8) {
        const __m256 a = ld8(base, off + i, dtype), b = ld8(base, off + i + half, dtype);
        const __m256 c1 = ld8(cos, co + i, dtype), s1 = ld8(sin, co + i, dtype);
        const __m256 c2 = ld8(cos, co + i + half, dtype), s2 = ld8(sin, co + i + half, dtype);
        st8(base, off + i, _mm256_sub_ps(_mm256_mul_ps(a, c1), _mm256_mul_ps(b, s1)), dtype);
        st8(base, off + i + half, _mm256_add_ps(_mm256_mul_ps(b, c2), _mm256_mul_ps(a, s2)), dtype);
    }
}

static inline __attribute__((always_inline)) void rope8(void *q, void *k, const void *cos, const void *sin,
                                                        int64_t T, int H, int Hk, int D, int64_t q_stride,
                                                        int64_t k_stride, const int dtype) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (BIG(T * (H + Hk) * (int64_t)D))
    for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) rope_head8(q, t * q_stride + (int64_t)h * D, cos, sin, t * D, half, dtype);
        for (int h = 0; h < Hk; ++h) rope_head8(k, t * k_stride + (int64_t)h * D, cos, sin, t * D, half, dtype);
    }
}
#else
#define CB_FAST8(n) 0
#endif

/* The widest loops this build has for rows of n values: 16 lanes, else 8, else portable; each
 * instantiated per dtype so its loops see a constant dtype. */
#define DISPATCH(n, name, ...)                                                                                         \
    do {                                                                                                               \
        DISPATCH16(n, name, __VA_ARGS__);                                                                              \
        DISPATCH8(n, name, __VA_ARGS__);                                                                               \
        if (dtype == 0) name##_impl(__VA_ARGS__, 0);                                                                   \
        else name##_impl(__VA_ARGS__, 1);                                                                              \
        return 0;                                                                                                      \
    } while (0)
#if defined(__AVX512F__)
#define DISPATCH16(n, name, ...)                                                                                       \
    if (CB_FAST(n)) {                                                                                                  \
        if (dtype == 0) name##16(__VA_ARGS__, 0);                                                                      \
        else name##16(__VA_ARGS__, 1);                                                                                 \
        return 0;                                                                                                      \
    }
#else
#define DISPATCH16(n, name, ...)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define DISPATCH8(n, name, ...)                                                                                        \
    if (CB_FAST8(n)) {                                                                                                 \
        if (dtype == 0) name##8(__VA_ARGS__, 0);                                                                       \
        else name##8(__VA_ARGS__, 1);                                                                                  \
        return 0;                                                                                                      \
    }
#else
#define DISPATCH8(n, name, ...)
#endif

int cbgen_add_rmsnorm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t n,
                      int64_t x_stride, int64_t delta_stride, int64_t out_stride, float eps, int dtype) {
    DISPATCH(n, add_rmsnorm, x, delta, weight, out, rows, n, x_stride, delta_stride, out_stride, eps);
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

#if defined(__AVX512F__)
/* One head's rotation, 16 lanes at a time (half % 16 == 0).  Products and the sum are separate
 * roundings, as the scalar loop and torch's mul/add compute them (no fused multiply-add). */
static inline __attribute__((always_inline)) void rope_head16(void *base, int64_t off, const void *cos,
                                                              const void *sin, int64_t co, int half,
                                                              const int dtype) {
    for (int i = 0; i < half; i += 16) {
        const __m512 a = ld16(base, off + i, dtype), b = ld16(base, off + i + half, dtype);
        const __m512 c1 = ld16(cos, co + i, dtype), s1 = ld16(sin, co + i, dtype);
        const __m512 c2 = ld16(cos, co + i + half, dtype), s2 = ld16(sin, co + i + half, dtype);
        st16(base, off + i, _mm512_sub_ps(_mm512_mul_ps(a, c1), _mm512_mul_ps(b, s1)), dtype);
        st16(base, off + i + half, _mm512_add_ps(_mm512_mul_ps(b, c2), _mm512_mul_ps(a, s2)), dtype);
    }
}

/* Why: the portable loop does not vectorise (its head loop picks q or k per head) and cost ~4.5 us a
 * token at 12 heads of 64, ~9 ms of a 64-row decode step over 30 layers; this runs ~20x faster. */
static inline __attribute__((always_inline)) void rope16(void *q, void *k, const void *cos, const void *sin,
                                                         int64_t T, int H, int Hk, int D, int64_t q_stride,
                                                         int64_t k_stride, const int dtype) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (BIG(T * (H + Hk) * (int64_t)D))
    for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) rope_head16(q, t * q_stride + (int64_t)h * D, cos, sin, t * D, half, dtype);
        for (int h = 0; h < Hk; ++h) rope_head16(k, t * k_stride + (int64_t)h * D, cos, sin, t * D, half, dtype);
    }
}
#endif

int cbgen_rope(void *q, void *k, const void *cos, const void *sin, int64_t T, int H, int Hk, int D,
               int64_t q_stride, int64_t k_stride, int dtype) {
    DISPATCH(D / 2, rope, q, k, cos, sin, T, H, Hk, D, q_stride, k_stride);
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
    DISPATCH(n, silu_mul, gate, up, out, rows, n, gate_stride, up_stride, out_stride);
}

/* Greedy rows of the sampler in one kernel: for each row of x [B, V] (float32 or bf16, row stride
 * `stride`), the first index of its maximum (a NaN counts as the maximum, as in torch.argmax), the
 * maximum itself, and log(sum(exp(x - max))) + max in double.  Why: for a greedy batch the sampler
 * otherwise makes several passes over B x V logits (block maxima, argmax, a shifted exp, sums), which
 * at SmolLM2's 49k vocabulary cost ~10 ms a step; this is one read for the maximum, one for the sum.
 * The two loops have AVX2 forms: GCC left the plain ones scalar for -march=native on an AVX2-only AMD
 * EPYC (its exp's rounding and the NaN test were "control flow"), 9.1 ms for 64 rows there, 2.7 with
 * them. */
static void greedy_row(const float *row, int64_t V, int64_t *argmax, float *maxv, double *lse) {
    /* Vectorised maximum and NaN test, then a scan for the first index holding it. */
    float m = -INFINITY;
    int nan = 0;
    int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    {
        __m256 mx[4], un = _mm256_setzero_ps();
        for (int u = 0; u < 4; ++u) mx[u] = _mm256_set1_ps(-INFINITY);
        for (; i0 + 32 <= V; i0 += 32)
            for (int u = 0; u < 4; ++u) {
                const __m256 v = _mm256_loadu_ps(row + i0 + 8 * u);
                mx[u] = _mm256_max_ps(mx[u], v);
                un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
        for (int k = 0; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
        nan = _mm256_movemask_ps(un) != 0;
    }
#endif
    for (int64_t i = i0; i < V; ++i) {
        const float v = row[i];
        m = v > m ? v : m;
        nan |= v != v;
    }
    int64_t best = 0;
    if (nan) {
        while (row[best] == row[best]) ++best;
        m = row[best];
    } else {
        while (best < V - 1 && row[best] != m) ++best;
    }
    *argmax = best;
    *maxv = m;
    if (nan || m == INFINITY || m == -INFINITY) {
        *lse = nan ? (double)NAN : (m == INFINITY ? (double)INFINITY : -(double)INFINITY);
        return;
    }
    double total = 0.0;
    for (int64_t c = 0; c < V; c += 1024) {
        const int64_t e = c + 1024 < V ? c + 1024 : V;
        float part = 0.0f;
        int64_t i = c;
#if defined(__AVX2__) && defined(__FMA__)
        {
            const __m256 mm = _mm256_set1_ps(m);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (; i + 16 <= e; i += 16) {
                a0 = _mm256_add_ps(a0, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mm)));
                a1 = _mm256_add_ps(a1, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i + 8), mm)));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
            for (int k = 0; k < 8; ++k) part += lanes[k];
        }
#endif
        for (; i < e; ++i) part += exp_approx(row[i] - m);
        total += part;
    }
    *lse = (double)m + log(total);
}

/* dtype 0 = float32, 1 = bfloat16 logits (each row widened into a per-thread float32 buffer first:
 * the loops above vectorise on float32, and a row of 49k floats stays in L2). */
int cbgen_greedy_rows(const void *x, int64_t B, int64_t V, int64_t stride, int64_t *argmax, float *maxv,
                      double *lse, int dtype) {
    int failed = 0;
#pragma omp parallel if (BIG(B * V))
    {
        float *buf = dtype == 0 ? NULL : (float *)malloc(sizeof(float) * (size_t)V);
        if (dtype != 0 && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B; ++r) {
            if (dtype == 0) {
                greedy_row((const float *)x + r * stride, V, argmax + r, maxv + r, lse + r);
            } else if (buf) {
                const uint16_t *src = (const uint16_t *)x + r * stride;
                uint32_t *dst = (uint32_t *)buf;
#pragma omp simd
                for (int64_t i = 0; i < V; ++i) dst[i] = (uint32_t)src[i] << 16;
                greedy_row(buf, V, argmax + r, maxv + r, lse + r);
            }
        }
        free(buf);
    }
    return failed;
}
