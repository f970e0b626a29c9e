/* A bfloat16 GEMM for the projections on CPUs with AVX512-BF16: out = x W^T (+ bias), bf16 in and
 * out, float32 sums, through vdpbf16ps (each instruction: 16 columns x 2 k of exact bf16 products).
 *
 * Why: on a 2-core AMD EPYC Zen 4 (family 25 model 17, AVX-512 + AVX512-BF16, no AMX) oneDNN ran
 * SmolLM2's bf16 projections at ~335 GFLOP/s at 64 decode rows, and the panel GEMM (cpu_panel.c:
 * bf16 widened to float32, AVX2 FMAs) at ~150, so the measured choice took oneDNN; the one-call C
 * decode step (cpu_decoder.c) cannot call oneDNN, and the Python loop around oneDNN cost ~6 ms of a
 * ~70 ms step.  This kernel is a GEMM the C step can call with no widening at all.
 *
 * Packed layout (cbgen_dp_pack): panels[ceil(N / 32)][ceil(K / 2)][32][2]: for output column n and
 * input k, panel n / 32, pair k / 2, lane n % 32, slot k % 2.  One pair row of a panel is two 512-bit
 * vectors, each 16 columns x (k, k + 1), which is what vdpbf16ps multiplies with a broadcast pair of
 * x.  Columns past N and the slot past an odd K are zero.
 *
 * Tiles: up to 12 rows x 32 columns in 24 accumulators; per k pair, two weight loads and a
 * broadcast of x per row feed 24 vdpbf16ps.  Threads take panels as they ask (dynamic), and each
 * panel serves every row tile of a chunk of rows from cache, so at decode sizes a weight byte crosses
 * the memory bus once per call.
 *
 * vdpbf16ps treats subnormal inputs as zero and flushes subnormal sums, and it sums a pair before
 * adding it to the total: the results are a float32 GEMM's up to summation order and those
 * subnormals, which is how oneDNN's and torch's bf16 GEMMs are specified too (none of them fixes an
 * order).  The output is rounded once, to nearest even, after the bias is added in float32.
 *
 * Returns 0; 1 for bad sizes or a packed size that does not match (checked before any memory is
 * touched); 2 when built without AVX512-BF16. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen_numerics.h"

enum { DP_COLS = 32, DP_ROWS = 12 };
/* Rows of x per chunk: every panel rereads them, so they stay in L2 (192 x 1536 bf16 is 576 KB). */
enum { DP_CHUNK_ROWS = 192 };

static int64_t dp_packed_elems(int64_t N, int64_t K) {
    return (N + DP_COLS - 1) / DP_COLS * ((K + 1) / 2) * DP_COLS * 2;
}

int cbgen_dp_pack(const uint16_t *w, int64_t w_stride, int64_t N, int64_t K, uint16_t *packed, int64_t packed_size) {
    if (N < 1 || K < 1 || w_stride < K || packed_size != dp_packed_elems(N, K)) return 1;
    const int64_t panels = (N + DP_COLS - 1) / DP_COLS, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kp = 0; kp < pairs; ++kp)
            for (int c = 0; c < DP_COLS; ++c)
                for (int s = 0; s < 2; ++s) {
                    const int64_t n = p * DP_COLS + c, k = 2 * kp + s;
                    packed[((p * pairs + kp) * DP_COLS + c) * 2 + s] = n < N && k < K ? w[n * w_stride + k] : 0;
                }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* acc[r][0..31] = sum_k x[r, k] * W[n0 + 0..31, k] for r < rows (a constant after inlining, so the
 * accumulators are registers). */
static inline __attribute__((always_inline)) void dp_tile(const uint16_t *x, int64_t xs, const uint16_t *panel,
                                                         int64_t K, float *acc, const int rows) {
    __m512 lo[DP_ROWS], hi[DP_ROWS];
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; ++kp) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * DP_COLS);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * DP_COLS + DP_COLS);
        for (int r = 0; r < rows; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
        }
    }
    if (K & 1) { /* the last k alone: its pair's second slot is zero in x as in the panel */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * DP_COLS);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * DP_COLS + DP_COLS);
        for (int r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int32_t)x[r * xs + K - 1]);
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
        }
    }
    for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(acc + r * DP_COLS, lo[r]);
        _mm512_storeu_ps(acc + r * DP_COLS + 16, hi[r]);
    }
}

static void dp_tile_any(const uint16_t *x, int64_t xs, const uint16_t *panel, int64_t K, float *acc, int rows) {
    switch (rows) {
    case 12: dp_tile(x, xs, panel, K, acc, 12); break;
    case 11: dp_tile(x, xs, panel, K, acc, 11); break;
    case 10: dp_tile(x, xs, panel, K, acc, 10); break;
    case 9: dp_tile(x, xs, panel, K, acc, 9); break;
    case 8: dp_tile(x, xs, panel, K, acc, 8); break;
    case 7: dp_tile(x, xs, panel, K, acc, 7); break;
    case 6: dp_tile(x, xs, panel, K, acc, 6); break;
    case 5: dp_tile(x, xs, panel, K, acc, 5); break;
    case 4: dp_tile(x, xs, panel, K, acc, 4); break;
    case 3: dp_tile(x, xs, panel, K, acc, 3); break;
    case 2: dp_tile(x, xs, panel, K, acc, 2); break;
    default: dp_tile(x, xs, panel, K, acc, 1); break;
    }
}

/* Writes rows x cols (cols <= 32) of acc, plus the bias when there is one, to out at (m0, n0),
 * rounded to bf16.  Without a bias nothing is added (adding 0 would turn a -0 sum into +0). */
static void dp_store(const float *acc, int rows, int cols, const uint16_t *bias, uint16_t *out, int64_t os,
                     int64_t m0, int64_t n0) {
    float b[DP_COLS] = {0};
    if (bias)
        for (int j = 0; j < cols; ++j) b[j] = bf16_to_f32(bias[n0 + j]);
    for (int r = 0; r < rows; ++r) {
        const float *a = acc + r * DP_COLS;
        uint16_t *o = out + (m0 + r) * os + n0;
        if (cols == DP_COLS) {
            for (int h = 0; h < DP_COLS; h += 16) {
                __m512 v = _mm512_loadu_ps(a + h);
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(b + h));
                _mm256_storeu_si256((__m256i *)(o + h), _mm512_cvtepi32_epi16(bf16_bits16(v)));
            }
        } else {
            for (int j = 0; j < cols; ++j) o[j] = f32_to_bf16(bias ? a[j] + b[j] : a[j]);
        }
    }
}

int cbgen_dp_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t packed_size,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1 || x_stride < K || out_stride < N) return 1;
    if (packed_size != dp_packed_elems(N, K)) return 1;
    const int64_t panels = (N + DP_COLS - 1) / DP_COLS, panel_elems = (K + 1) / 2 * 2 * DP_COLS;
    for (int64_t c0 = 0; c0 < M; c0 += DP_CHUNK_ROWS) {
        const int64_t c1 = c0 + DP_CHUNK_ROWS < M ? c0 + DP_CHUNK_ROWS : M;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; ++p) {
            float acc[DP_ROWS * DP_COLS];
            const int64_t n0 = p * DP_COLS;
            const int cols = (int)(N - n0 < DP_COLS ? N - n0 : DP_COLS);
            const uint16_t *panel = packed + p * panel_elems;
            for (int64_t m0 = c0; m0 < c1; m0 += DP_ROWS) {
                const int rows = (int)(c1 - m0 < DP_ROWS ? c1 - m0 : DP_ROWS);
                dp_tile_any(x + m0 * x_stride, x_stride, panel, K, acc, rows);
                dp_store(acc, rows, cols, bias, out, out_stride, m0, n0);
            }
        }
    }
    return 0;
}

int cbgen_dp_available(void) { return 1; }
#else
int cbgen_dp_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t packed_size,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)x_stride, (void)packed, (void)packed_size, (void)bias, (void)out, (void)out_stride;
    (void)M, (void)N, (void)K;
    return 2;
}

int cbgen_dp_available(void) { return 0; }
#endif
