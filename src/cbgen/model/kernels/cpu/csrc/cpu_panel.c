/* A float32-accumulating GEMM for the projections on CPUs with AVX2 + FMA: out = x W^T (+ bias),
 * with W packed once into panels of 16 output columns.
 *
 * Why: on a 2-core AMD EPYC (AVX2 only, two 8-lane FMAs a cycle: 189 GFLOP/s measured on both cores
 * with register operands) oneDNN ran SmolLM2's projections at 46-61 GFLOP/s at 64 decode rows, and
 * there the projections are ~75% of a float32 step.  This is the textbook register-blocked kernel:
 * a tile of 6 rows x 16 columns lives in 12 accumulators; per k it loads 16 weights (two vectors)
 * and broadcasts 6 inputs for 12 FMAs.  On that CPU it is bound by vector loads, not FMAs (a loop
 * of 3 loads per 12 FMAs ran at peak, this one's 8 at ~38%, as does oneDNN at 2,048 rows), and
 * reached ~70 GFLOP/s from 64 rows up: 1.2-1.5x oneDNN at decode sizes, even at prefill sizes.  It
 * is a candidate of the measured GEMM choice (gemm_choice.py): where a library GEMM is faster, that
 * one runs.
 *
 * Packed layout (cbgen_panel_pack): panels[ceil(N / 16)][K][16], column n of the weight at panel
 * n / 16, lane n % 16; the columns past N in the last panel are zero.  Panels are float32 (pdtype 0;
 * a bfloat16 weight widened exactly) or, for a bfloat16 weight, bfloat16 (pdtype 1: half the bytes,
 * widened by a shift as they are loaded, which costs vector ops the FMAs need: on the EPYC the
 * float32 panels won at 64 rows and the bfloat16 ones where the weight stream decides).  A bfloat16
 * x is widened into a scratch copy first and the output rounded once, to nearest even, as torch does.
 *
 * Loop order: rows are cut into chunks that stay in the last-level cache; within a chunk the threads
 * share out panels in contiguous ranges (cbgen_ranges.h; a panel is read from memory once per chunk
 * and then from L2 for every 6-row tile), so at decode sizes (one chunk) each weight byte crosses the
 * memory bus once per call.
 *
 * dtype: 0 = float32, 1 = bfloat16 (x, the weight, bias and out); pdtype: the panels' (0, or 1
 * when dtype is 1).  Strides in elements.  Returns 0; 1 for bad sizes or a packed size that does
 * not match (checked before any memory is touched); 2 when built without AVX2 + FMA; 3 when the
 * bfloat16 scratch cannot be had. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cbgen_numerics.h"
#include "cbgen_ranges.h"

enum { PANEL = 16, TILE_ROWS = 6 };
/* Rows of x per chunk: reread once per panel, so they should stay in cache (192 x 1536 floats is
 * 1.2 MB); 192 beat 96 at every shape timed, and splitting K did not help. */
enum { CHUNK_ROWS = 192 };

static inline float load_elem(const void *p, int64_t i, const int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static int64_t packed_elems(int64_t N, int64_t K) {
    return (N + PANEL - 1) / PANEL * K * PANEL;
}

int cbgen_panel_pack(const void *w, int64_t w_stride, int64_t N, int64_t K, int dtype, void *packed,
                     int64_t packed_size, int pdtype) {
    if (N < 1 || K < 1 || dtype < 0 || dtype > 1 || pdtype > dtype || pdtype < 0 || w_stride < K) return 1;
    if (packed_size != packed_elems(N, K)) return 1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t k = 0; k < K; ++k)
            for (int j = 0; j < PANEL; ++j) {
                const int64_t n = p * PANEL + j, at = (p * K + k) * PANEL + j;
                if (pdtype == 0) ((float *)packed)[at] = n < N ? load_elem(w, n * w_stride + k, dtype) : 0.0f;
                else ((uint16_t *)packed)[at] = n < N ? ((const uint16_t *)w)[n * w_stride + k] : 0;
            }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* acc[r][0..15] = sum_k x[r, k] * panel[k][0..15] for r < rows (rows a constant after inlining, so
 * the accumulators are registers). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const void *panel, int64_t K,
                                                      float *acc, const int rows, const int dtype) {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m256 w0, w1;
        if (dtype == 0) {
            w0 = _mm256_loadu_ps((const float *)panel + k * PANEL);
            w1 = _mm256_loadu_ps((const float *)panel + k * PANEL + 8);
        } else { /* 16 bfloat16 in one load, widened by a shift */
            const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + k * PANEL));
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
            w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
        }
#pragma GCC unroll 6
        for (int r = 0; r < rows; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);
            lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_ps(acc + r * PANEL, lo[r]);
        _mm256_storeu_ps(acc + r * PANEL + 8, hi[r]);
    }
}

#define TILE_CASES(d)                                                                                                  \
    switch (rows) {                                                                                                    \
    case 6: tile(x, xs, panel, K, acc, 6, d); break;                                                                   \
    case 5: tile(x, xs, panel, K, acc, 5, d); break;                                                                   \
    case 4: tile(x, xs, panel, K, acc, 4, d); break;                                                                   \
    case 3: tile(x, xs, panel, K, acc, 3, d); break;                                                                   \
    case 2: tile(x, xs, panel, K, acc, 2, d); break;                                                                   \
    default: tile(x, xs, panel, K, acc, 1, d); break;                                                                  \
    }

/* One tile with the row count and weight dtype as constants, so each variant's loop is unrolled. */
static void tile_any(const float *x, int64_t xs, const void *panel, int64_t K, float *acc, int rows, int dtype) {
    if (dtype == 0) TILE_CASES(0) else TILE_CASES(1)
}

/* Adds the bias and writes rows x cols (cols <= 16) of acc to out at (m0, n0). */
static void store_tile(const float *acc, int rows, int cols, const void *bias, void *out, int64_t os, int64_t m0,
                       int64_t n0, int dtype) {
    float b[PANEL] = {0};
    if (bias)
        for (int j = 0; j < cols; ++j) b[j] = load_elem(bias, n0 + j, dtype);
    for (int r = 0; r < rows; ++r) {
        const float *a = acc + r * PANEL;
        if (dtype == 0) {
            float *o = (float *)out + (m0 + r) * os + n0;
            if (cols == PANEL) {
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
                _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(b + 8)));
            } else {
                for (int j = 0; j < cols; ++j) o[j] = a[j] + b[j];
            }
        } else {
            uint16_t *o = (uint16_t *)out + (m0 + r) * os + n0;
            if (cols == PANEL) { /* rounded 8 lanes at a time: the scalar loop was ~2% of a bf16 decode step */
                for (int h = 0; h < PANEL; h += 8)
                    store_bf16x8(o + h, bf16_bits8(_mm256_add_ps(_mm256_loadu_ps(a + h), _mm256_loadu_ps(b + h))));
            } else {
                for (int j = 0; j < cols; ++j) o[j] = f32_to_bf16(a[j] + b[j]);
            }
        }
    }
}

int cbgen_panel_gemm(const void *x, int64_t x_stride, const void *packed, int64_t packed_size, const void *bias,
                     void *out, int64_t out_stride, int64_t M, int64_t N, int64_t K, int dtype, int pdtype) {
    if (M < 1 || N < 1 || K < 1 || dtype < 0 || dtype > 1 || pdtype > dtype || pdtype < 0) return 1;
    if (x_stride < K || out_stride < N) return 1;
    if (packed_size != packed_elems(N, K)) return 1;
    const float *xf = (const float *)x;
    int64_t xs = x_stride;
    float *scratch = 0;
    if (dtype == 1) {
        scratch = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!scratch) return 3;
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k) scratch[m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * x_stride + k]);
        xf = scratch;
        xs = K;
    }
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int ranges = cb_ranges(omp_get_max_threads());
    cb_range_cursor cursor[CB_MAX_RANGES];
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK_ROWS) {
        const int64_t c1 = c0 + CHUNK_ROWS < M ? c0 + CHUNK_ROWS : M;
        cb_ranges_reset(cursor, ranges, panels); /* panels shared out in ranges (cbgen_ranges.h) */
#pragma omp parallel num_threads(ranges)
        {
            float acc[TILE_ROWS * PANEL];
            cb_claim claim = {cursor, panels, ranges, omp_get_thread_num(), 0};
            for (int64_t p; (p = cb_next(&claim)) >= 0;) {
                const int64_t n0 = p * PANEL;
                const int cols = (int)(N - n0 < PANEL ? N - n0 : PANEL);
                const void *panel = pdtype == 0 ? (const void *)((const float *)packed + p * K * PANEL)
                                                : (const void *)((const uint16_t *)packed + p * K * PANEL);
                for (int64_t m0 = c0; m0 < c1; m0 += TILE_ROWS) {
                    const int rows = (int)(c1 - m0 < TILE_ROWS ? c1 - m0 : TILE_ROWS);
                    tile_any(xf + m0 * xs, xs, panel, K, acc, rows, pdtype);
                    store_tile(acc, rows, cols, bias, out, out_stride, m0, n0, dtype);
                }
            }
        }
    }
    free(scratch);
    return 0;
}
#else
int cbgen_panel_gemm(const void *x, int64_t x_stride, const void *packed, int64_t packed_size, const void *bias,
                     void *out, int64_t out_stride, int64_t M, int64_t N, int64_t K, int dtype, int pdtype) {
    (void)x, (void)x_stride, (void)packed, (void)packed_size, (void)bias, (void)out, (void)out_stride;
    (void)M, (void)N, (void)K, (void)dtype, (void)pdtype;
    return 2;
}
#endif
