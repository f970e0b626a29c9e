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

static inline float ld(const void *p, int64_t i, const int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* A float32 result stored in dtype: bfloat16 rounds to nearest even (the value the next op reads). */
static inline float rounded(float v, const int dtype) {
    return dtype == 0 ? v : bf16_to_f32(f32_to_bf16(v));
}

static inline void st(void *p, int64_t i, float v, const int dtype) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* sq[r, i] = float(y)^2 where y = h[r, i] (o NULL) or y = h + o, stored to out (the residual add):
 * the module forward's `hidden = residual + x` then RMSNorm's `h = hidden.to(float32); h.pow(2)`. */
int cbgen_parity_add_square(const void *h, int64_t hs, const void *o, int64_t os, void *out, int64_t out_s,
                            float *sq, int64_t rows, int64_t n, int dtype) {
    if (rows < 0 || n < 0 || (dtype != 0 && dtype != 1) || hs < n || (o && (os < n || out_s < n))) return 1;
    if (!h || !sq || (o && !out)) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        float *s = sq + r * n;
        if (o) {
            for (int64_t i = 0; i < n; i++) {
                const float y = rounded(ld(h, r * hs + i, dtype) + ld(o, r * os + i, dtype), dtype);
                st(out, r * out_s + i, y, dtype);
                s[i] = y * y;
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                const float y = ld(h, r * hs + i, dtype);
                s[i] = y * y;
            }
        }
    }
    return 0;
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
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float rs = 1.0f / sqrtf(sum[r] / count + eps);
        for (int64_t i = 0; i < n; i++) {
            const float y = rounded(ld(x, r * xs + i, dtype) * rs, dtype);
            st(out, r * out_s + i, ld(w, i, dtype) * y, dtype);
        }
    }
    return 0;
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
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_FROM)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t hd = 0; hd < heads; hd++) {
            const int64_t xi = t * xs + hd * d, oi = t * out_s + hd * d;
            for (int64_t i = 0; i < d; i++) {
                const float c = ld(cos, t * cs + i, dtype), s = ld(sin, t * cs + i, dtype);
                const float rot = i < half ? -ld(x, xi + i + half, dtype) : ld(x, xi + i - half, dtype);
                const float a = rounded(ld(x, xi + i, dtype) * c, dtype);
                const float b = rounded(rot * s, dtype);
                st(out, oi + i, a + b, dtype);
            }
        }
    }
    return 0;
}

/* out[r, i] = a[r, i] * b[r, i], rounded to dtype: torch's `a * b` (SwiGLU's `act_fn(gate) * up`).
 * out may be a. */
int cbgen_parity_mul(const void *a, int64_t as, const void *b, int64_t bs, void *out, int64_t out_s, int64_t rows,
                     int64_t n, int dtype) {
    if (rows < 0 || n < 0 || (dtype != 0 && dtype != 1) || as < n || bs < n || out_s < n) return 1;
    if (!a || !b || !out) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) st(out, r * out_s + i, ld(a, r * as + i, dtype) * ld(b, r * bs + i, dtype), dtype);
    return 0;
}
