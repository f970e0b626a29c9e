/* The elementwise steps of parity mode's direct forward (cbgen/batch_invariant/direct_forward.py),
 * each one call where the module forward runs a chain of torch's elementwise ops.
 *
 * Bit for bit, each computes what that chain computes: the same IEEE operations on the same values
 * in the same order, each result rounded where torch rounds it (float32 ops in float32; bfloat16 ops
 * widened exactly, computed in float32 and rounded once to nearest even, as torch's CPU kernels do).
 * No reduction happens here: the one reduction of an RMSNorm (the sum inside the mean of the
 * squares) stays torch's own call on the squares these kernels write, so its order is the
 * trainer's.  The file is compiled in ISO C mode, where GCC fuses no a * b + c into one rounding,
 * and every loop element is independent, so threading changes no bit.  The engine also checks the
 * whole forward against the module forward bit for bit before it uses it.
 *
 * dtype: 0 = float32, 1 = bfloat16.  Strides in elements.  Sizes are checked before any memory is
 * touched: rc 1 = bad sizes or dtype. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cbgen_numerics.h"

/* Below this many elements a call runs on one thread: the fork costs more than the loop. */
enum { PARALLEL_FROM = 1 << 16 };

/* Every loop below is written once over a dtype that is a constant where it is expanded (the *_row
 * and *_head helpers take it as an argument and are always inlined into a branch per dtype), with no
 * branch left in the element loop, so GCC vectorises it.  Vector and scalar forms of these operations give
 * the same IEEE results; only contraction could change a bit, and ISO C mode forbids it. */
#define AI static inline __attribute__((always_inline))

AI float ld(const void *p, int64_t i, const int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f32_to_bf16 without its early return (a select instead), so a loop using it vectorises. */
AI uint16_t bf16_of(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
}

/* A float32 result stored in dtype: bfloat16 rounds to nearest even (the value the next op reads). */
AI float rounded(float v, const int dtype) {
    if (dtype == 0) return v;
    const uint32_t bits = (uint32_t)bf16_of(v) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

AI void st(void *p, int64_t i, float v, const int dtype) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = bf16_of(v);
}

AI void add_square_row(const void *h, const void *o, void *out, float *s, int64_t n, const int dtype) {
    if (o) {
        for (int64_t i = 0; i < n; i++) {
            const float y = rounded(ld(h, i, dtype) + ld(o, i, dtype), dtype);
            st(out, i, y, dtype);
            s[i] = y * y;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            const float y = ld(h, i, dtype);
            s[i] = y * y;
        }
    }
}

static inline size_t elem(int dtype) { return dtype == 0 ? sizeof(float) : sizeof(uint16_t); }

/* sq[r, i] = float(y)^2 where y = h[r, i] (o NULL) or y = h + o, stored to out (the residual add):
 * the module forward's `hidden = residual + x` then RMSNorm's `h = hidden.to(float32); h.pow(2)`. */
int cbgen_parity_add_square(const void *h, int64_t hs, const void *o, int64_t os, void *out, int64_t out_s,
                            float *sq, int64_t rows, int64_t n, int dtype) {
    if (rows < 0 || n < 0 || (dtype != 0 && dtype != 1) || hs < n || (o && (os < n || out_s < n))) return 1;
    if (!h || !sq || (o && !out)) return 1;
    const size_t e = elem(dtype);
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const char *hr = (const char *)h + r * hs * e;
        const char *orow = o ? (const char *)o + r * os * e : NULL;
        char *outr = o ? (char *)out + r * out_s * e : NULL;
        if (dtype == 0) add_square_row(hr, orow, outr, sq + r * n, n, 0);
        else add_square_row(hr, orow, outr, sq + r * n, n, 1);
    }
    return 0;
}

AI void norm_row(const void *x, float rs, const void *w, void *out, int64_t n, const int dtype) {
    for (int64_t i = 0; i < n; i++) {
        const float y = rounded(ld(x, i, dtype) * rs, dtype);
        st(out, i, ld(w, i, dtype) * y, dtype);
    }
}

/* out[r, i] = w[i] * dtype(float(x[r, i]) * (1 / sqrt(sum[r] / n + eps))): RMSNorm's
 * `variance = h.pow(2).mean(-1)` from torch's own sum of the squares (torch's mean is that sum
 * divided by the count, in float32), `h * torch.rsqrt(variance + eps)`, `.to(input_dtype)` and
 * `weight * h` (torch's rsqrt is the correctly rounded 1 / sqrt in float32, vector and scalar
 * alike). */
int cbgen_parity_norm_apply(const void *x, int64_t xs, const float *sum, float eps, const void *w, void *out,
                            int64_t out_s, int64_t rows, int64_t n, int dtype) {
    if (rows < 0 || n <= 0 || (dtype != 0 && dtype != 1) || xs < n || out_s < n) return 1;
    if (!x || !sum || !w || !out) return 1;
    const float count = (float)n;
    const size_t e = elem(dtype);
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float rs = 1.0f / sqrtf(sum[r] / count + eps);
        const char *xr = (const char *)x + r * xs * e;
        char *outr = (char *)out + r * out_s * e;
        if (dtype == 0) norm_row(xr, rs, w, outr, n, 0);
        else norm_row(xr, rs, w, outr, n, 1);
    }
    return 0;
}

/* One head: out = x * cos + rotate_half(x) * sin, the halves as two loops so neither branches. */
AI void rope_head(const void *x, const void *c, const void *s, void *out, int64_t half, const int dtype) {
    for (int64_t i = 0; i < half; i++) {
        const float a = rounded(ld(x, i, dtype) * ld(c, i, dtype), dtype);
        const float b = rounded(-ld(x, i + half, dtype) * ld(s, i, dtype), dtype);
        st(out, i, a + b, dtype);
    }
    for (int64_t i = half; i < 2 * half; i++) {
        const float a = rounded(ld(x, i, dtype) * ld(c, i, dtype), dtype);
        const float b = rounded(ld(x, i - half, dtype) * ld(s, i, dtype), dtype);
        st(out, i, a + b, dtype);
    }
}

/* out[t, h, :] = x * cos + rotate_half(x) * sin for x = x[t, h, :] (heads at stride d, rows at stride
 * xs), cos and sin rows of d at stride cs: transformers' apply_rotary_pos_emb, each product and the sum
 * rounded to dtype.  out is [rows, heads, d] at row stride out_s. */
int cbgen_parity_rope(const void *x, int64_t xs, int64_t heads, int64_t d, const void *cos, const void *sin,
                      int64_t cs, void *out, int64_t out_s, int64_t rows, int dtype) {
    if (rows < 0 || heads < 0 || d < 0 || d % 2 || (dtype != 0 && dtype != 1)) return 1;
    if (xs < heads * d || out_s < heads * d || cs < d) return 1;
    if (!x || !cos || !sin || !out) return 1;
    const int64_t half = d / 2;
    const size_t e = elem(dtype);
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_FROM)
    for (int64_t t = 0; t < rows; t++) {
        const char *c = (const char *)cos + t * cs * e, *s = (const char *)sin + t * cs * e;
        for (int64_t hd = 0; hd < heads; hd++) {
            const char *xh = (const char *)x + (t * xs + hd * d) * e;
            char *oh = (char *)out + (t * out_s + hd * d) * e;
            if (dtype == 0) rope_head(xh, c, s, oh, half, 0);
            else rope_head(xh, c, s, oh, half, 1);
        }
    }
    return 0;
}

AI void mul_row(const void *a, const void *b, void *out, int64_t n, const int dtype) {
    for (int64_t i = 0; i < n; i++) st(out, i, ld(a, i, dtype) * ld(b, i, dtype), dtype);
}

/* out[r, i] = a[r, i] * b[r, i], rounded to dtype: torch's `a * b` (SwiGLU's `act_fn(gate) * up`).
 * out may be a. */
int cbgen_parity_mul(const void *a, int64_t as, const void *b, int64_t bs, void *out, int64_t out_s, int64_t rows,
                     int64_t n, int dtype) {
    if (rows < 0 || n < 0 || (dtype != 0 && dtype != 1) || as < n || bs < n || out_s < n) return 1;
    if (!a || !b || !out) return 1;
    const size_t e = elem(dtype);
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const char *ar = (const char *)a + r * as * e, *br = (const char *)b + r * bs * e;
        char *outr = (char *)out + r * out_s * e;
        if (dtype == 0) mul_row(ar, br, outr, n, 0);
        else mul_row(ar, br, outr, n, 1);
    }
    return 0;
}

/* SwiGLU's act_fn(gate) * up as the module forward computes it under parity mode: torch's SiLU over
 * whole vectors (cbgen/batch_invariant/lanes.py), its result rounded to dtype, then the product
 * rounded to dtype.  torch's vectorised SiLU is x / (1 + exp(-x)) in float32 with exp torch's own
 * vector function; the caller passes that very function (exp_fn, found in libtorch and checked
 * against torch.silu before use: cbgen/batch_invariant/kernels/cpu_parity_rows.py) and its width (16: a
 * __m512 -> __m512 function, 8: __m256 -> __m256).  A row's last partial vector is padded with
 * zeros, so every element goes through the vector function, as lanes.py arranges for torch.
 * gate_up is [rows, 2 inter] (the gate, then up) at row stride gs; out [rows, inter] at out_s.
 * rc 1 = bad sizes, dtype or width, 2 = built without that width's vectors. */
#if defined(__AVX512F__)
typedef __m512 (*exp16_fn)(__m512);
#endif
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 (*exp8_fn)(__m256);
#endif

enum { SILU_MAX_WIDTH = 16 };

/* The whole-vector part of a row, the same operations as silu_mul_row below in vector registers. */
#if defined(__AVX512F__)
AI __m512 round16(__m512 v, const int dtype) {
    return dtype == 0 ? v : _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}

AI int64_t silu_mul_vec16(const void *g, const void *u, void *out, int64_t n, exp16_fn exp, const int dtype) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = ld16(g, i, dtype);
        const __m512 e = exp(_mm512_xor_ps(x, sign));
        const __m512 p = _mm512_mul_ps(round16(_mm512_div_ps(x, _mm512_add_ps(one, e)), dtype), ld16(u, i, dtype));
        if (dtype == 0) _mm512_storeu_ps((float *)out + i, p);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(bf16_bits16(p)));
    }
    return i;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
AI __m256 round8(__m256 v, const int dtype) {
    return dtype == 0 ? v : _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

AI int64_t silu_mul_vec8(const void *g, const void *u, void *out, int64_t n, exp8_fn exp, const int dtype) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = ld8(g, i, dtype);
        const __m256 e = exp(_mm256_xor_ps(x, sign));
        const __m256 p = _mm256_mul_ps(round8(_mm256_div_ps(x, _mm256_add_ps(one, e)), dtype), ld8(u, i, dtype));
        if (dtype == 0) _mm256_storeu_ps((float *)out + i, p);
        else store_bf16x8((uint16_t *)out + i, bf16_bits8(p));
    }
    return i;
}
#endif

AI void silu_mul_row(const void *g, const void *u, void *out, int64_t n, const void *exp_fn, const int width,
                     const int dtype) {
    int64_t start = 0;
#if defined(__AVX512F__)
    if (width == 16) start = silu_mul_vec16(g, u, out, n, (exp16_fn)exp_fn, dtype);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (width == 8) start = silu_mul_vec8(g, u, out, n, (exp8_fn)exp_fn, dtype);
#endif
    /* The last partial vector (or, without vector registers here, nothing: the call was refused). */
    for (int64_t i0 = start; i0 < n; i0 += width) {
        const int m = n - i0 < width ? (int)(n - i0) : width;
        float x[SILU_MAX_WIDTH] = {0}, e[SILU_MAX_WIDTH];
        for (int l = 0; l < m; l++) x[l] = -ld(g, i0 + l, dtype);
#if defined(__AVX512F__)
        if (width == 16) _mm512_storeu_ps(e, ((exp16_fn)exp_fn)(_mm512_loadu_ps(x)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (width == 8) _mm256_storeu_ps(e, ((exp8_fn)exp_fn)(_mm256_loadu_ps(x)));
#endif
        for (int l = 0; l < m; l++) {
            const float s = rounded(-x[l] / (1.0f + e[l]), dtype);
            st(out, i0 + l, s * ld(u, i0 + l, dtype), dtype);
        }
    }
}

int cbgen_parity_silu_mul(const void *gate_up, int64_t gs, int64_t inter, void *out, int64_t out_s, int64_t rows,
                          const void *exp_fn, int width, int dtype) {
    if (rows < 0 || inter < 0 || (dtype != 0 && dtype != 1) || gs < 2 * inter || out_s < inter) return 1;
    if (!gate_up || !out || !exp_fn || (width != 8 && width != 16)) return 1;
#if !defined(__AVX512F__)
    if (width == 16) return 2;
#endif
#if !defined(__AVX2__) || !defined(__FMA__)
    if (width == 8) return 2;
#endif
    const size_t e = elem(dtype);
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + r * gs * e, *u = g + inter * e;
        char *o = (char *)out + r * out_s * e;
        if (dtype == 0) silu_mul_row(g, u, o, inter, exp_fn, width, 0);
        else silu_mul_row(g, u, o, inter, exp_fn, width, 1);
    }
    return 0;
}
