/* bfloat16 GEMM on Intel AMX for the small-row projections of CPU decode steps.
 *
 * Why: a decode step multiplies ~64 rows by every weight of the model once, so its projections are
 * bound by streaming the weights from memory (270 MB a step for SmolLM2 in bf16, ~21 GB/s here),
 * not by arithmetic.  oneDNN's packed GEMM ran them at ~8 GB/s of weights once the KV reads of
 * attention had pushed the weights out of the caches.  This kernel reads its packed weight as one
 * sequential stream per thread, prefetched ~32 KiB ahead into L2, with the rows of the small
 * activation matrix held in L1/L2: 1.3-1.7x oneDNN on hot weights and ~1.6x on cold ones.
 *
 * y[M, N] = x[M, K] W[N, K]^T (+ bias), fp32 accumulation, one rounding to bf16 at the end (what
 * torch's bf16 linear computes; summation order may differ, so ~1e-4 of outputs differ by one ulp).
 *
 * Packed weight layout (cpu_amx.amx_pack): for each pair of 16-column blocks p (N / 32 of them)
 * and each 32-wide slice kb of K, two 1 KiB tiles j = 0, 1 in the AMX "VNNI" layout: tile row r
 * holds, for columns c = 0..15, the pair W[32p + 16j + c][32kb + 2r + {0, 1}].  A thread walks
 * consecutive p, so its share of the weight is one contiguous stream.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cbgen_numerics.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux grants a process the AMX tile state only on request; 1 when granted. */
int cbgen_amx_init(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Rows of activations kept hot while a thread sweeps its columns (~300 KiB at K = 576). */
#define ROW_CHUNK 256
/* How far ahead of the tile loads the weight stream is prefetched into L2, in bf16 elements. */
#define PREFETCH_AHEAD 16384

/* Rows [m, m + 32) (or 16 when `two` is 0) of the columns of pair `bp`: 2 x 2 tiles of 16 x 16 fp32
 * accumulators, stored to `acc` [32][32]. */
static inline void tile_block(const uint16_t *a, int64_t as, const uint16_t *bp, int64_t kbs, int two, int prefetch,
                              float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *a1 = a + 16 * as;
    for (int64_t kb = 0; kb < kbs; ++kb) {
        const uint16_t *b = bp + kb * 1024;
        if (prefetch) {
            const char *q = (const char *)(b + PREFETCH_AHEAD);
            for (int l = 0; l < 2048; l += 64) _mm_prefetch(q + l, _MM_HINT_T1);
        }
        _tile_loadd(6, b, 64);
        _tile_loadd(4, a + kb * 32, as * 2);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + kb * 32, as * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    if (two) {
        _tile_stored(2, acc + 512, 128);
        _tile_stored(3, acc + 528, 128);
    }
}

/* out[M, N] (row stride os) = x[M, K] (row stride xs) . W^T + bias (NULL: none), all bf16.
 * Returns 0, 1 for shapes it does not take (N or K not a multiple of 32), 2 when out of memory. */
int cbgen_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                     int64_t os, int64_t M, int64_t N, int64_t K) {
    if (N % 32 || K % 32 || M <= 0) return 1;
    const int64_t kbs = K / 32, pairs = N / 32, mp = (M + 15) & ~(int64_t)15;
    const uint16_t *a = x;
    int64_t as = xs;
    uint16_t *pad = NULL;
    if (mp != M) { /* tiles are 16 rows: a zero-padded copy (a few KiB) instead of a second config */
        pad = aligned_alloc(64, (size_t)(mp * K * 2 + 63) & ~(size_t)63);
        if (!pad) return 2;
        for (int64_t r = 0; r < M; ++r) memcpy(pad + r * K, x + r * xs, (size_t)K * 2);
        memset(pad + M * K, 0, (size_t)((mp - M) * K * 2));
        a = pad;
        as = K;
    }
#pragma omp parallel if (pairs >= 2)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; ++i) {
            cfg.colsb[i] = 64;
            cfg.rows[i] = 16;
        }
        _tile_loadconfig(&cfg);
        float acc[32 * 32] __attribute__((aligned(64)));
        for (int64_t mc = 0; mc < mp; mc += ROW_CHUNK) {
            const int64_t mend = mc + ROW_CHUNK < mp ? mc + ROW_CHUNK : mp;
            /* Static and identical for every chunk: a thread always owns the same columns. */
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < pairs; ++p) {
                const uint16_t *bp = wp + p * kbs * 1024;
                const __m512 b0 = bias ? ld16(bias, p * 32, 1) : _mm512_setzero_ps();
                const __m512 b1 = bias ? ld16(bias, p * 32 + 16, 1) : _mm512_setzero_ps();
                for (int64_t m = mc; m < mend; m += 32) {
                    tile_block(a + m * as, as, bp, kbs, m + 16 < mend, m == mc, acc);
                    const int64_t rows = (m + 32 < M ? m + 32 : M) - m;
                    for (int64_t r = 0; r < rows; ++r) {
                        uint16_t *o = out + (m + r) * os + p * 32;
                        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc + r * 32), b0);
                        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(acc + r * 32 + 16), b1);
                        _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(bf16_bits16(v0)));
                        _mm256_storeu_si256((__m256i *)(o + 16), _mm512_cvtepi32_epi16(bf16_bits16(v1)));
                    }
                }
            }
        }
        _tile_release();
    }
    free(pad);
    return 0;
}

#else /* no AMX in this build */

int cbgen_amx_init(void) { return 0; }

int cbgen_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                     int64_t os, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)xs, (void)wp, (void)bias, (void)out, (void)os, (void)M, (void)N, (void)K;
    return 1;
}

#endif
