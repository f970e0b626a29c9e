/* GEMMs for the projections on CPUs with AVX-512: out = x W^T (+ bias), with W packed once into
 * panels of 32 output columns, float32 sums.
 *
 *   cbgen_p512_*  float32: panels [ceil(N / 32)][K][32]; per k, two weight vectors and a broadcast
 *                 of x per row feed two FMAs a row.
 *   cbgen_dp_*    bfloat16 (AVX512-BF16): panels [ceil(N / 32)][ceil(K / 2)][32][2], column n's
 *                 pair (k, k + 1) at lane n % 32 of pair row k / 2, so one 512-bit vector is 16
 *                 columns x 2 k, what vdpbf16ps multiplies with a broadcast pair of x.  No value is
 *                 widened; the output is rounded once, to nearest even, after the bias.
 * Columns past N (and the slot past an odd K) are zero.
 *
 * Why: on a 2-core AMD EPYC Zen 4 (family 25 model 17, AVX-512 + AVX512-BF16, no AMX) the panel GEMM
 * (cpu_panel.c: AVX2, 6 x 16 tiles, bf16 widened) ran SmolLM2's projections at 64 decode rows at
 * ~175 GFLOP/s in float32 and ~150 in bfloat16, below oneDNN's ~195 and ~370, so the measured choice
 * took oneDNN, which the one-call C decode step (cpu_decoder.c) cannot call: the Python loop around
 * it cost ~6 ms of a ~70 ms bf16 step.  These tiles, 14 rows x 32 columns in 28 accumulators, ran at
 * ~200 (float32) and ~385 (bfloat16) there: two weight loads and 14 broadcasts per 28 FMAs or
 * vdpbf16ps, where the AVX2 tile's 8 loads per 12 FMAs bound it by loads.
 *
 * Each thread streams a contiguous range of panels (p512_run), and each panel serves every row tile
 * of a chunk of rows from cache, so at decode sizes a weight byte crosses the memory bus once per
 * call.  Each output element is one chain over k (float32: an FMA per k; bf16: a vdpbf16ps per k
 * pair) in increasing order from zero, whatever M, the tile or the thread.  vdpbf16ps treats
 * subnormal inputs as zero and flushes subnormal results: the bf16 results are a float32 GEMM's up
 * to summation order and those subnormals, as oneDNN's and torch's bf16 GEMMs are specified
 * (neither fixes an order).
 *
 * Returns 0; 1 for bad sizes or a packed size that does not match (checked before any memory is
 * touched); 2 when built without AVX-512 (AVX512-BF16 for the bf16 GEMM). */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#include "cbgen_numerics.h"
#include "cbgen_ranges.h"

enum { P512_COLS = 32, P512_ROWS = 14 };
/* Rows of x per chunk: every panel rereads them, so they stay in L2 (192 x 1536 bf16 is 576 KB). */
enum { P512_CHUNK_ROWS = 192 };

static int64_t p512_elems(int64_t N, int64_t K) { return (N + P512_COLS - 1) / P512_COLS * K * P512_COLS; }
static int64_t dp_elems(int64_t N, int64_t K) { return (N + P512_COLS - 1) / P512_COLS * ((K + 1) / 2) * 2 * P512_COLS; }

int cbgen_p512_pack(const float *w, int64_t w_stride, int64_t N, int64_t K, float *packed, int64_t packed_size) {
    if (N < 1 || K < 1 || w_stride < K || packed_size != p512_elems(N, K)) return 1;
    const int64_t panels = (N + P512_COLS - 1) / P512_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int c = 0; c < P512_COLS; ++c) {
                const int64_t n = p * P512_COLS + c;
                packed[(p * K + k) * P512_COLS + c] = n < N ? w[n * w_stride + k] : 0.0f;
            }
    return 0;
}

int cbgen_dp_pack(const uint16_t *w, int64_t w_stride, int64_t N, int64_t K, uint16_t *packed, int64_t packed_size) {
    if (N < 1 || K < 1 || w_stride < K || packed_size != dp_elems(N, K)) return 1;
    const int64_t panels = (N + P512_COLS - 1) / P512_COLS, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kp = 0; kp < pairs; ++kp)
            for (int c = 0; c < P512_COLS; ++c)
                for (int s = 0; s < 2; ++s) {
                    const int64_t n = p * P512_COLS + c, k = 2 * kp + s;
                    packed[((p * pairs + kp) * P512_COLS + c) * 2 + s] = n < N && k < K ? w[n * w_stride + k] : 0;
                }
    return 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The tile function with the row count as a constant (so the accumulators are registers). */
#define P512_ROW_CASES(tile, ...)                                                                                      \
    switch (rows) {                                                                                                    \
    case 14: tile(__VA_ARGS__, 14); break;                                                                             \
    case 13: tile(__VA_ARGS__, 13); break;                                                                             \
    case 12: tile(__VA_ARGS__, 12); break;                                                                             \
    case 11: tile(__VA_ARGS__, 11); break;                                                                             \
    case 10: tile(__VA_ARGS__, 10); break;                                                                             \
    case 9: tile(__VA_ARGS__, 9); break;                                                                               \
    case 8: tile(__VA_ARGS__, 8); break;                                                                               \
    case 7: tile(__VA_ARGS__, 7); break;                                                                               \
    case 6: tile(__VA_ARGS__, 6); break;                                                                               \
    case 5: tile(__VA_ARGS__, 5); break;                                                                               \
    case 4: tile(__VA_ARGS__, 4); break;                                                                               \
    case 3: tile(__VA_ARGS__, 3); break;                                                                               \
    case 2: tile(__VA_ARGS__, 2); break;                                                                               \
    default: tile(__VA_ARGS__, 1); break;                                                                              \
    }

/* acc[r][0..31] = sum_k x[r, k] * W[n0 + 0..31, k] for r < rows, float32. */
static inline __attribute__((always_inline)) void p512_tile(const float *x, int64_t xs, const float *panel, int64_t K,
                                                           float *acc, const int rows) {
    __m512 lo[P512_ROWS], hi[P512_ROWS];
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * P512_COLS), w1 = _mm512_loadu_ps(panel + k * P512_COLS + 16);
        for (int r = 0; r < rows; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * xs + k]);
            lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
            hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(acc + r * P512_COLS, lo[r]);
        _mm512_storeu_ps(acc + r * P512_COLS + 16, hi[r]);
    }
}

static void p512_tile_any(const float *x, int64_t xs, const float *panel, int64_t K, float *acc, int rows) {
    P512_ROW_CASES(p512_tile, x, xs, panel, K, acc)
}

#if defined(__AVX512BF16__)
/* acc[r][0..31] = sum_k x[r, k] * W[n0 + 0..31, k] for r < rows, bf16 pairs into vdpbf16ps. */
static inline __attribute__((always_inline)) void dp_tile(const uint16_t *x, int64_t xs, const uint16_t *panel,
                                                         int64_t K, float *acc, const int rows) {
    __m512 lo[P512_ROWS], hi[P512_ROWS];
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; ++kp) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * P512_COLS);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * P512_COLS + P512_COLS);
        for (int r = 0; r < rows; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
        }
    }
    if (K & 1) { /* the last k alone: its pair's second slot is zero in x as in the panel */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * P512_COLS);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * P512_COLS + P512_COLS);
        for (int r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int32_t)x[r * xs + K - 1]);
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
        }
    }
    for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(acc + r * P512_COLS, lo[r]);
        _mm512_storeu_ps(acc + r * P512_COLS + 16, hi[r]);
    }
}

static void dp_tile_any(const uint16_t *x, int64_t xs, const uint16_t *panel, int64_t K, float *acc, int rows) {
    P512_ROW_CASES(dp_tile, x, xs, panel, K, acc)
}
#endif

/* Writes rows x cols (cols <= 32) of acc, plus the bias when there is one, to out at (m0, n0), as
 * float32 or rounded to bf16.  Without a bias nothing is added (adding 0 would turn a -0 sum into
 * +0). */
static void p512_store(const float *acc, int rows, int cols, const void *bias, void *out, int64_t os, int64_t m0,
                       int64_t n0, const int bf16) {
    float b[P512_COLS]; /* read only with a bias (zeroing it per tile was 2% of a bf16 decode step) */
    if (bias)
        for (int j = 0; j < P512_COLS; ++j)
            b[j] = j >= cols ? 0.0f
                   : bf16  ? bf16_to_f32(((const uint16_t *)bias)[n0 + j])
                           : ((const float *)bias)[n0 + j];
    const __mmask16 m_lo = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1u);
    const __mmask16 m_hi = (__mmask16)(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1u);
    for (int r = 0; r < rows; ++r) {
        const float *a = acc + r * P512_COLS;
        for (int h = 0; h < P512_COLS; h += 16) {
            const __mmask16 m = h ? m_hi : m_lo;
            if (!m) continue;
            __m512 v = _mm512_loadu_ps(a + h);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(b + h));
            if (bf16)
                _mm256_mask_storeu_epi16((uint16_t *)out + (m0 + r) * os + n0 + h, m,
                                         _mm512_cvtepi32_epi16(bf16_bits16(v)));
            else
                _mm512_mask_storeu_ps((float *)out + (m0 + r) * os + n0 + h, m, v);
        }
    }
}

/* The shared driver: every row tile of a chunk of rows per panel, panels shared out in ranges
 * (cbgen_ranges.h). */
static int p512_run(const void *x, int64_t xs, const void *packed, const void *bias, void *out, int64_t os, int64_t M,
                    int64_t N, int64_t K, const int bf16) {
    const int64_t panels = (N + P512_COLS - 1) / P512_COLS;
    const int64_t panel_elems = bf16 ? (K + 1) / 2 * 2 * P512_COLS : K * P512_COLS;
    const int ranges = cb_ranges(omp_get_max_threads());
    cb_range_cursor cursor[CB_MAX_RANGES];
    for (int64_t c0 = 0; c0 < M; c0 += P512_CHUNK_ROWS) {
        const int64_t c1 = c0 + P512_CHUNK_ROWS < M ? c0 + P512_CHUNK_ROWS : M;
        cb_ranges_reset(cursor, ranges, panels);
#pragma omp parallel num_threads(ranges)
        {
            float acc[P512_ROWS * P512_COLS];
            cb_claim claim = {cursor, panels, ranges, omp_get_thread_num(), 0};
            for (int64_t p; (p = cb_next(&claim)) >= 0;) {
                const int64_t n0 = p * P512_COLS;
                const int cols = (int)(N - n0 < P512_COLS ? N - n0 : P512_COLS);
                for (int64_t m0 = c0; m0 < c1; m0 += P512_ROWS) {
                    const int rows = (int)(c1 - m0 < P512_ROWS ? c1 - m0 : P512_ROWS);
#if defined(__AVX512BF16__)
                    if (bf16)
                        dp_tile_any((const uint16_t *)x + m0 * xs, xs, (const uint16_t *)packed + p * panel_elems, K,
                                    acc, rows);
                    else
#endif
                        p512_tile_any((const float *)x + m0 * xs, xs, (const float *)packed + p * panel_elems, K, acc,
                                      rows);
                    p512_store(acc, rows, cols, bias, out, os, m0, n0, bf16);
                }
            }
        }
    }
    return 0;
}
#endif

int cbgen_p512_gemm(const float *x, int64_t x_stride, const float *packed, int64_t packed_size, const float *bias,
                    float *out, int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1 || x_stride < K || out_stride < N || packed_size != p512_elems(N, K)) return 1;
#if defined(__AVX512F__)
    return p512_run(x, x_stride, packed, bias, out, out_stride, M, N, K, 0);
#else
    (void)bias, (void)out;
    return 2;
#endif
}

int cbgen_dp_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t packed_size,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1 || x_stride < K || out_stride < N || packed_size != dp_elems(N, K)) return 1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return p512_run(x, x_stride, packed, bias, out, out_stride, M, N, K, 1);
#else
    (void)bias, (void)out;
    return 2;
#endif
}

/* Which of these GEMMs this build has: bit 0 the float32 one (AVX-512), bit 1 the bf16 one. */
int cbgen_p512_built(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 3;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
