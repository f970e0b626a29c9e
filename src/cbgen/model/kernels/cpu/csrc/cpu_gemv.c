/* Projections of a few rows (a single sequence's decode step): y = x W^T (+ bias), the weight read
 * once, straight from the user's [N, K] tensor.
 *
 * Why: with one row, every GEMM torch offers here (MKL, oneDNN packed or not) streamed the weights at
 * 8-10 GB/s on a 2-core AMD EPYC whose memory delivers ~20 GB/s to a plain sum, and at one row a
 * decode step is nothing but that stream (SmolLM2: 540 MB of float32 weights a token).  Here each
 * thread takes a contiguous range of output rows and walks four weight rows side by side, so every
 * thread reads one sequential region the hardware prefetcher follows; the x rows stay in L1.
 *
 * Portable C with GCC vector extensions (8 float lanes: AVX2 with -march=native on x86, two SSE or
 * NEON registers elsewhere).  Accumulates in float32 (bfloat16 inputs widened by a shift), and rounds
 * a bfloat16 output once, to nearest even, as torch does.
 *
 * dtype: 0 = float32, 1 = bfloat16 (x, weight, bias and out share it).  Strides are in elements.
 * Returns 0, or 1 for bad sizes (checked before any memory is touched). */
#include <stdint.h>
#include <string.h>

#include "cbgen_numerics.h"

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

enum { GEMV_MAX_ROWS = 8, GROUP = 4 };

static inline __attribute__((always_inline)) v8f load8(const void *p, int64_t i, const int dtype) {
    v8f v;
    if (dtype == 0) {
        memcpy(&v, (const float *)p + i, sizeof v);
    } else {
        v8h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&v, &u, sizeof v);
    }
    return v;
}

static inline float load1(const void *p, int64_t i, const int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Output rows [n0, n0 + g) (g <= GROUP) for every x row. */
static inline __attribute__((always_inline)) void rows_group(const void *x, int64_t xs, const void *w, int64_t ws,
                                                            const void *bias, void *out, int64_t os, int64_t M,
                                                            int64_t n0, int g, int64_t K, const int dtype) {
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t m = 0; m < M; ++m) {
        v8f acc[GROUP] = {{0}};
        for (int64_t k = 0; k < K8; k += 8) {
            const v8f xv = load8(x, m * xs + k, dtype);
            for (int j = 0; j < g; ++j) acc[j] += load8(w, (n0 + j) * ws + k, dtype) * xv;
        }
        for (int j = 0; j < g; ++j) {
            float s = hsum8(acc[j]);
            for (int64_t k = K8; k < K; ++k) s += load1(w, (n0 + j) * ws + k, dtype) * load1(x, m * xs + k, dtype);
            if (bias) s += load1(bias, n0 + j, dtype);
            if (dtype == 0) ((float *)out)[m * os + n0 + j] = s;
            else ((uint16_t *)out)[m * os + n0 + j] = f32_to_bf16(s);
        }
    }
}

int cbgen_gemv(const void *x, int64_t x_stride, const void *w, int64_t w_stride, const void *bias, void *out,
               int64_t out_stride, int64_t M, int64_t N, int64_t K, int dtype) {
    if (M < 1 || M > GEMV_MAX_ROWS || N < 1 || K < 1 || dtype < 0 || dtype > 1) return 1;
    if (x_stride < K || w_stride < K || out_stride < N) return 1;
    const int64_t groups = (N + GROUP - 1) / GROUP;
    /* Runs of groups handed out as threads ask: a static split made the first thread wait ~30% of the
     * call at the closing barrier for a worker that woke late.  A run is still one contiguous stretch
     * of the weight (at least 16 groups). */
    const int64_t run = groups / 32 > 16 ? groups / 32 : 16;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r0 = 0; r0 < groups; r0 += run) {
        const int64_t r1 = r0 + run < groups ? r0 + run : groups;
        for (int64_t gi = r0; gi < r1; ++gi) {
            const int64_t n0 = gi * GROUP;
            const int g = (int)(N - n0 < GROUP ? N - n0 : GROUP);
            if (dtype == 0) rows_group(x, x_stride, w, w_stride, bias, out, out_stride, M, n0, g, K, 0);
            else rows_group(x, x_stride, w, w_stride, bias, out, out_stride, M, n0, g, K, 1);
        }
    }
    return 0;
}
