/* The attention of parity mode (LLM(batch_invariant=True) and cbgen.parity(model)) on the CPU: each
 * query's output computed in one fixed order that depends on its position and head_dim only, never
 * on how many rows share the call, how they are threaded, or where the keys came from (a paged cache
 * or the same forward).  The engine and the trainer call the same function, so their results are
 * equal bit for bit.  (Parity mode's matrix products are the panel GEMM of cpu_panel.c, whose every
 * element is one sequential chain of fused multiply-adds over k, whatever the row count.)
 *
 * The order is defined by the arithmetic, not by the ISA: every product-sum is a float32 fused
 * multiply-add (one rounding); a dot product keeps 8 partial sums (lane l takes d = l, l + 8, ...),
 * folded by one fixed tree, then the D % 8 tail in order.  The AVX2 + FMA code and the portable code
 * compute the same bits (fmaf rounds once, as vfmadd does); the file is compiled in ISO C mode,
 * where GCC contracts no a * b + c by itself.
 *
 * dtype: 0 = float32, 1 = bfloat16 (inputs widened exactly, accumulation in float32, outputs rounded
 * once to nearest even).  Strides in elements.  Every size and index is checked before any memory is
 * touched: rc 1 = bad sizes, 2 = an index (row, position, block) out of range, 3 = no memory for
 * scratch. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen_numerics.h"

/* LANES: the partial sums of a dot product (see the passes below). */
enum { LANES = 8 };

/* Keys and values are read through the block table, so the hardware prefetcher does not run ahead
 * of a row of keys: each kv head's pass asks for its own lines of the key or value PF positions
 * ahead, non-temporal (each line is read once a step).  A task walks its keys in chunks of
 * CHUNK_KEYS, every kv head over a chunk before the next, so the chunk's rows stay in L1 across
 * heads.  Measured on a Zen 4 (AMD EPYC family 25 model 17), SmolLM2's heads, bf16, 30 layers of
 * scattered blocks (cold): 128 rows x 230 keys 91 -> 69 ms (the default decode kernel 55), 64 x
 * 1,000 200 -> 151 ms (123); the former order (whole rows one kv head at a time, 8 positions ahead
 * into every cache level, all heads' lines prefetched in the first head's pass) and longer
 * distances or chunks were slower.  Prefetches and loop order change no arithmetic. */
enum { PF = 24, CHUNK_KEYS = 16 };

static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
}

static inline float load1(const void *p, int64_t i, const int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store1(void *p, int64_t i, float v, const int dtype) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* The fixed fold of 8 partial sums. */
static inline float fold8(const float *a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* exp(x) for a score minus its row's maximum (x <= 0), the same bits in the scalar and the 8-lane
 * form below: x clamped to [-80, 0] (e^-80 ~ 2e-35 stays a normal float, so no denormal mode can
 * change a result), k = nearest(x log2 e), r = x - k ln 2 in two fused steps (Cody-Waite), e^r by a
 * degree-7 polynomial (Cephes' expf coefficients) in fused multiply-adds, times 2^k (exact).  About
 * 1 ulp, where libm's scalar expf made the exponentials most of the kernel's time. */
static const float EXP_LOG2E = 1.44269504088896341f, EXP_C1 = 0.693359375f, EXP_C2 = -2.12194440e-4f;
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_score(float x) {
    x = x > -80.0f ? x : -80.0f; /* a NaN becomes -80, as vmaxps(x, -80) gives */
    x = x < 0.0f ? x : 0.0f;
    const float k = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(-k, EXP_C1, x);
    r = fmaf(-k, EXP_C2, r);
    float p = EXP_P[0];
    for (int i = 1; i < 6; ++i) p = fmaf(p, r, EXP_P[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m256 widen8(const void *p, int64_t i, const int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The two passes of one task (a row and a key/value head) over its n keys, key j at element offset
 * offs[j] of the key and of the value store (they share strides).  The group's query heads are
 * blocked NH at a time so that their sums stay in registers while each key or value is loaded once;
 * what each head computes is what it would compute alone:
 *   score:  8 partial sums over d (lane l takes d = l, l + 8, ... below D8), acc = fma(q, k, acc),
 *           folded by fold8, then d = D8 .. D - 1 in order, times scale (then the soft cap);
 *   values: acc[d] = fma(e_j, v_j[d], acc[d]) for j = 0, 1, ..., n - 1. */
enum { NH_MAX = 3, SCORE_KEYS = 4, VALUE_VECS = 4 };

/* fold8 of four 8-lane sums at once: (lo + hi) pairs lanes l and l + 4, two horizontal adds then
 * take ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), fold8's order. */
static inline __m128 fold8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m128 ta = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 tb = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 tc = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
    const __m128 td = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
    return _mm_hadd_ps(_mm_hadd_ps(ta, tb), _mm_hadd_ps(tc, td));
}

/* Partial sums (folded) of keys j .. j + 3 for NH heads: sc[r][j + c] = fold8 of head r, key c.
 * Keys past n repeat key n - 1 and their results are not stored. */
static inline __attribute__((always_inline)) void score_keys(float *const *sc, const float *const *qf, const char *k,
                                                            const int64_t *offs, int64_t j, int64_t n, int64_t D8,
                                                            int64_t esize, const int NH, const int dtype, int64_t pf_n,
                                                            int64_t pf_bytes) {
    const char *kp[SCORE_KEYS];
#pragma GCC unroll 4
    for (int c = 0; c < SCORE_KEYS; ++c) kp[c] = k + offs[j + c < n ? j + c : n - 1] * esize;
    for (int c = 0; pf_bytes && c < SCORE_KEYS && j + PF + c < pf_n; ++c)
        prefetch_bytes(k + offs[j + PF + c] * esize, pf_bytes);
    __m256 acc[NH_MAX][SCORE_KEYS];
#pragma GCC unroll 3
    for (int r = 0; r < NH; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < SCORE_KEYS; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += LANES) {
        __m256 kv[SCORE_KEYS];
#pragma GCC unroll 4
        for (int c = 0; c < SCORE_KEYS; ++c) kv[c] = widen8(kp[c], d, dtype);
#pragma GCC unroll 3
        for (int r = 0; r < NH; ++r) {
            const __m256 qv = _mm256_loadu_ps(qf[r] + d);
#pragma GCC unroll 4
            for (int c = 0; c < SCORE_KEYS; ++c) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
        }
    }
    const int C = n - j < SCORE_KEYS ? (int)(n - j) : SCORE_KEYS;
#pragma GCC unroll 3
    for (int r = 0; r < NH; ++r) {
        float four[SCORE_KEYS];
        _mm_storeu_ps(four, fold8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        for (int c = 0; c < C; ++c) sc[r][j + c] = four[c];
    }
}

/* acc[r][d0 .. d0 + 8 NV) over all n values, for NH heads, the sums held in registers. */
static inline __attribute__((always_inline)) void weigh_values(float *const *acc, const float *const *e, const char *v,
                                                              const int64_t *offs, int64_t n, int64_t d0,
                                                              int64_t esize, const int NH, const int NV,
                                                              const int dtype, int64_t pf_n, int64_t pf_bytes) {
    __m256 a[NH_MAX][VALUE_VECS];
#pragma GCC unroll 3
    for (int r = 0; r < NH; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) a[r][u] = _mm256_loadu_ps(acc[r] + d0 + u * LANES);
    for (int64_t j = 0; j < n; ++j) {
        const char *vp = v + offs[j] * esize;
        if (pf_bytes && j + PF < pf_n) prefetch_bytes(v + (offs[j + PF] + d0) * esize, pf_bytes);
        __m256 vv[VALUE_VECS];
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) vv[u] = widen8(vp, d0 + u * LANES, dtype);
#pragma GCC unroll 3
        for (int r = 0; r < NH; ++r) {
            const __m256 ev = _mm256_set1_ps(e[r][j]);
#pragma GCC unroll 4
            for (int u = 0; u < NV; ++u) a[r][u] = _mm256_fmadd_ps(ev, vv[u], a[r][u]);
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < NH; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc[r] + d0 + u * LANES, a[r][u]);
}

#define SCORE_CASE(NH, DT)                                                                                   \
    case (NH) * 2 + (DT):                                                                                    \
        for (int64_t j = j0; j < n; j += SCORE_KEYS)                                                         \
            score_keys(sc, qf, k, offs, j, n, D8, esize, NH, DT, pf_n, pf_bytes);                            \
        break;

/* Both passes' blocked loops for nh <= NH_MAX heads (the scores' D8 part of keys j0 .. n - 1, the
 * values' D8 part of the n keys at offs and weights e); pf_bytes of the keys or values pf_n ... ahead
 * are prefetched (0: none). */
static void score_pass(float *const *sc, const float *const *qf, const char *k, const int64_t *offs, int64_t j0,
                       int64_t n, int64_t D8, int64_t esize, int nh, const int dtype, int64_t pf_n, int64_t pf_bytes) {
    switch (nh * 2 + dtype) {
        SCORE_CASE(1, 0) SCORE_CASE(1, 1) SCORE_CASE(2, 0) SCORE_CASE(2, 1) SCORE_CASE(3, 0) SCORE_CASE(3, 1)
    }
}

#define VALUE_CASE(NH, NV, DT)                                                                               \
    case ((NH) * 8 + (NV)) * 2 + (DT):                                                                       \
        weigh_values(acc, e, v, offs, n, d0, esize, NH, NV, DT, pf_n, d0 ? 0 : pf_bytes);                    \
        break;
#define VALUE_CASES(NH, DT) VALUE_CASE(NH, 1, DT) VALUE_CASE(NH, 2, DT) VALUE_CASE(NH, 3, DT) VALUE_CASE(NH, 4, DT)

static void value_pass(float *const *acc, const float *const *e, const char *v, const int64_t *offs, int64_t n,
                       int64_t D8, int64_t esize, int nh, const int dtype, int64_t pf_n, int64_t pf_bytes) {
    for (int64_t d0 = 0; d0 < D8; d0 += VALUE_VECS * LANES) {
        const int nv = (int)((D8 - d0) / LANES < VALUE_VECS ? (D8 - d0) / LANES : VALUE_VECS);
        switch ((nh * 8 + nv) * 2 + dtype) {
            VALUE_CASES(1, 0) VALUE_CASES(1, 1) VALUE_CASES(2, 0) VALUE_CASES(2, 1) VALUE_CASES(3, 0)
            VALUE_CASES(3, 1)
        }
    }
}

/* exp_score on 8 lanes, op for op. */
static inline __m256 exp_score8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-80.0f)), _mm256_setzero_ps());
    const __m256 k =
        _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 nk = _mm256_sub_ps(_mm256_setzero_ps(), k);
    __m256 r = _mm256_fmadd_ps(nk, _mm256_set1_ps(EXP_C1), x);
    r = _mm256_fmadd_ps(nk, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* s[j] = exp_score(s[j] - max s) for j < n; returns the normaliser: 8 partial sums (lane l takes
 * j = l, l + 8, ... below n - n % 8) folded by fold8, then the tail in order. */
static float exp_and_sum(float *s, int64_t n) {
    const int64_t n8 = n - n % LANES;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n8; j += LANES) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
    float lanes[LANES], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int l = 0; l < LANES; ++l) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t j = n8; j < n; ++j) top = s[j] > top ? s[j] : top;
    const __m256 topv = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += LANES) {
        const __m256 e = exp_score8(_mm256_sub_ps(_mm256_loadu_ps(s + j), topv));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    _mm256_storeu_ps(lanes, sum8);
    float norm = fold8(lanes);
    for (int64_t j = n8; j < n; ++j) norm += (s[j] = exp_score(s[j] - top));
    return norm;
}
#else
enum { NH_MAX = 3 };

static void score_pass(float *const *sc, const float *const *qf, const char *k, const int64_t *offs, int64_t j0,
                       int64_t n, int64_t D8, int64_t esize, int nh, const int dtype, int64_t pf_n, int64_t pf_bytes) {
    (void)pf_n, (void)pf_bytes;
    for (int r = 0; r < nh; ++r)
        for (int64_t j = j0; j < n; ++j) {
            const char *kp = k + offs[j] * esize;
            float s[LANES] = {0};
            for (int64_t d = 0; d < D8; d += LANES)
                for (int l = 0; l < LANES; ++l) s[l] = fmaf(qf[r][d + l], load1(kp, d + l, dtype), s[l]);
            sc[r][j] = fold8(s);
        }
}

static void value_pass(float *const *acc, const float *const *e, const char *v, const int64_t *offs, int64_t n,
                       int64_t D8, int64_t esize, int nh, const int dtype, int64_t pf_n, int64_t pf_bytes) {
    (void)pf_n, (void)pf_bytes;
    for (int r = 0; r < nh; ++r)
        for (int64_t j = 0; j < n; ++j)
            for (int64_t d = 0; d < D8; ++d) acc[r][d] = fmaf(e[r][j], load1(v + offs[j] * esize, d, dtype), acc[r][d]);
}

static float exp_and_sum(float *s, int64_t n) {
    const int64_t n8 = n - n % LANES;
    float top = -INFINITY, lanes[LANES] = {0};
    for (int64_t j = 0; j < n; ++j) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < n8; ++j) lanes[j % LANES] += (s[j] = exp_score(s[j] - top));
    float norm = fold8(lanes);
    for (int64_t j = n8; j < n; ++j) norm += (s[j] = exp_score(s[j] - top));
    return norm;
}
#endif

/* Attention for T query rows of H heads (q [T, H, D], any row and head strides) over a
 * paged key/value store [num_blocks, block_size, Hkv, D] (strides kv_block, kv_slot, kv_head; D
 * contiguous).  Row t belongs to table row row_seq[t] and sits at position row_pos[t] (-1: padding,
 * output 0); the key at position j of table row g is at logical index seq_start[g] + j of that row's
 * blocks.  Causal; window > 0 keeps keys j > p - window; softcap > 0 maps a score s to
 * softcap * tanh(s / softcap).  Each query: scores in the dot order above times scale, their
 * maximum, exp_score(s - max) and the normaliser (exp_and_sum's 8-lane order), then the weighted
 * values summed over its visible keys in increasing position, one fused multiply-add per key and
 * lane; out = values / normaliser. */
int cbgen_parity_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                           int64_t kv_block, int64_t kv_slot, int64_t kv_head, int64_t num_blocks, int64_t block_size,
                           const int32_t *table, int64_t table_stride, int64_t table_width, int64_t table_rows,
                           const int64_t *seq_start, const int64_t *row_seq, const int64_t *row_pos, void *out,
                           int64_t out_row_stride, int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale,
                           int64_t window, float softcap, int dtype) {
    if (T < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 1 || D > 4096 || dtype < 0 || dtype > 1) return 1;
    if (num_blocks < 1 || block_size < 1 || table_rows < 1 || table_width < 1 || table_stride < table_width) return 1;
    /* q and the caches may be any strided views (the caller's tensors vouch for their extent); out
     * is the caller's [T, H, D] buffer. */
    if (q_head_stride < 1 || q_row_stride < 1 || out_row_stride < H * D || window < 0) return 1;
    if (kv_head < 1 || kv_slot < 1 || kv_block < 1) return 1;
    int64_t longest = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t p = row_pos[t], g = row_seq[t];
        if (p < -1 || g < 0 || g >= table_rows) return 2;
        if (p < 0) continue;
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        const int64_t first = seq_start[g] + lo, last = seq_start[g] + p;
        if (seq_start[g] < 0 || last >= table_width * block_size) return 2;
        for (int64_t b = first / block_size; b <= last / block_size; ++b) {
            const int32_t blk = table[g * table_stride + b];
            if (blk < 0 || blk >= num_blocks) return 2;
        }
        if (p - lo + 1 > longest) longest = p - lo + 1;
    }
    const int64_t group = H / Hkv, esize = dtype == 0 ? 4 : 2;
    /* Per query head of a group: its scores, its query in float32 and its accumulator. */
    const int64_t per_head = longest + 2 * D;
    /* Tasks: whole rows when there are enough of them to keep every thread busy, its kv heads one
     * after the other on one core (as the default decode kernel, cpu_paged.c, found: a task per kv
     * head reads a third of each run of cache lines); otherwise one task per (row, kv head). */
    const int64_t split = T >= 4 * (int64_t)omp_get_max_threads() ? 1 : Hkv, heads_per_task = Hkv / split;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = (float *)malloc((size_t)(heads_per_task * group * per_head + 1) * sizeof(float));
        int64_t *offs = (int64_t *)malloc((size_t)(longest + 1) * sizeof(int64_t));
        if (!offs) free(buf), buf = NULL;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        /* One task per row (or per row and key/value head): its query heads share each key and
         * value load, NH_MAX at a time (score_pass, value_pass), and its keys are walked in chunks
         * of CHUNK_KEYS, every kv head of the task over a chunk before the next chunk, so a chunk's
         * keys and values are read from memory once for all heads (the task's first head prefetches
         * whole rows ahead).  Only the loop order changes with the chunking: every head's scores,
         * normaliser and per-element value sums are the same operations in the same order. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * split; ++task) {
            if (!buf) continue;
            const int64_t t = task / split, p = row_pos[t], g = row_seq[t];
            const int64_t kh0 = task % split * heads_per_task, nq = heads_per_task * group;
            if (p < 0) {
                for (int64_t h = kh0 * group; h < kh0 * group + nq; ++h)
                    for (int64_t d = 0; d < D; ++d) store1((char *)out + (t * out_row_stride + h * D) * esize, d, 0.0f, dtype);
                continue;
            }
            /* Query head i (of the task's nq, kv head kh0 + i / group): scores, query, accumulator. */
            for (int64_t i = 0; i < nq; ++i) {
                const char *qp = (const char *)q + (t * q_row_stride + (kh0 * group + i) * q_head_stride) * esize;
                float *qf = buf + i * per_head + longest, *acc = qf + D;
                for (int64_t d = 0; d < D; ++d) qf[d] = load1(qp, d, dtype), acc[d] = 0.0f;
            }
            const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
            const int64_t D8 = D - D % LANES;
            const int32_t *row_table = table + g * table_stride;
            /* Walked block by block: one division per task, not one per key. */
            for (int64_t j = 0, b = (seq_start[g] + lo) / block_size, slot = (seq_start[g] + lo) % block_size; j < n;
                 ++b, slot = 0) {
                const int64_t base = row_table[b] * kv_block;
                for (; slot < block_size && j < n; ++slot, ++j) offs[j] = base + slot * kv_slot;
            }
            /* Pass 0: the scores, chunk by chunk; then each head's scale, soft cap and normaliser;
             * pass 1: the weighted values, chunk by chunk. */
            float norms[nq];
            for (int pass = 0; pass < 2; ++pass) {
                if (pass == 1)
                    for (int64_t i = 0; i < nq; ++i) {
                        float *sc = buf + i * per_head;
                        const float *qf = sc + longest;
                        const char *kbase = (const char *)k + (kh0 + i / group) * kv_head * esize;
                        for (int64_t j = 0; j < n; ++j) {
                            const char *kp = kbase + offs[j] * esize;
                            float sv = sc[j];
                            for (int64_t d = D8; d < D; ++d) sv = fmaf(qf[d], load1(kp, d, dtype), sv);
                            sv *= scale;
                            if (softcap > 0.0f) sv = softcap * tanhf(sv / softcap);
                            sc[j] = sv;
                        }
                        norms[i] = exp_and_sum(sc, n);
                    }
                for (int64_t j0 = 0; j0 < n; j0 += CHUNK_KEYS) {
                    const int64_t j1 = j0 + CHUNK_KEYS < n ? j0 + CHUNK_KEYS : n;
                    for (int64_t kh = kh0; kh < kh0 + heads_per_task; ++kh)
                        for (int64_t r0 = 0; r0 < group; r0 += NH_MAX) {
                            const int nh = group - r0 < NH_MAX ? (int)(group - r0) : NH_MAX;
                            const int64_t pf_bytes = r0 == 0 ? D * esize : 0; /* the kv head's own lines */
                            float *head[NH_MAX];
                            for (int r = 0; r < nh; ++r) head[r] = buf + ((kh - kh0) * group + r0 + r) * per_head;
                            if (pass == 0) {
                                const float *qf[NH_MAX];
                                for (int r = 0; r < nh; ++r) qf[r] = head[r] + longest;
                                score_pass(head, qf, (const char *)k + kh * kv_head * esize, offs, j0, j1, D8, esize,
                                           nh, dtype, n, pf_bytes);
                            } else {
                                float *acc[NH_MAX];
                                const float *e[NH_MAX];
                                for (int r = 0; r < nh; ++r) e[r] = head[r] + j0, acc[r] = head[r] + longest + D;
                                value_pass(acc, e, (const char *)v + kh * kv_head * esize, offs + j0, j1 - j0, D8,
                                           esize, nh, dtype, n - j0, pf_bytes);
                            }
                        }
                }
            }
            for (int64_t i = 0; i < nq; ++i) {
                float *head = buf + i * per_head, *acc = head + longest + D;
                const char *vbase = (const char *)v + (kh0 + i / group) * kv_head * esize;
                for (int64_t j = 0; j < n && D8 < D; ++j) {
                    const char *vp = vbase + offs[j] * esize;
                    for (int64_t d = D8; d < D; ++d) acc[d] = fmaf(head[j], load1(vp, d, dtype), acc[d]);
                }
                char *o = (char *)out + (t * out_row_stride + (kh0 * group + i) * D) * esize;
                for (int64_t d = 0; d < D; ++d) store1(o, d, acc[d] / norms[i], dtype);
            }
        }
        free(buf);
        free(offs);
    }
    return failed ? 3 : 0;
}

/* Parity mode's log-probability of one token per row, the function both sides report with
 * (cbgen.token_logprobs): out[r] = (x[r, tok[r]] - m) - logf(s), where m is the row's maximum and
 * s = sum over the row of exp_score(x - m) (the attention's exp), summed in 8 partial sums (lane l
 * takes j = l, l + 8, ... below V - V % 8), folded by fold8, then the tail in order.  The order
 * depends on V alone, never on the rows around it, and the AVX2 and portable forms compute the same
 * bits.  A row holding a NaN, or whose maximum is infinite, gives NaN (as log_softmax does).  Reads
 * float32 or bfloat16 rows (dtype 0 / 1) at row stride xs; writes float32.  The token ids are checked
 * before any row is read: rc 1 = bad sizes, 2 = a token out of range. */
#if defined(__AVX2__) && defined(__FMA__)
static float row_logprob(const void *x, int64_t V, int64_t tok, const int dtype) {
    const int64_t V8 = V - V % LANES;
    __m256 top8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < V8; j += LANES) {
        const __m256 v = widen8(x, j, dtype);
        top8 = _mm256_max_ps(top8, v);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[LANES], top = -INFINITY;
    int bad = _mm256_movemask_ps(nan8) != 0;
    _mm256_storeu_ps(lanes, top8);
    for (int l = 0; l < LANES; ++l) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t j = V8; j < V; ++j) {
        const float v = load1(x, j, dtype);
        bad |= v != v;
        top = v > top ? v : top;
    }
    if (bad || isinf(top)) return NAN;
    const __m256 topv = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < V8; j += LANES) sum8 = _mm256_add_ps(sum8, exp_score8(_mm256_sub_ps(widen8(x, j, dtype), topv)));
    _mm256_storeu_ps(lanes, sum8);
    float sum = fold8(lanes);
    for (int64_t j = V8; j < V; ++j) sum += exp_score(load1(x, j, dtype) - top);
    return (load1(x, tok, dtype) - top) - logf(sum);
}
#else
static float row_logprob(const void *x, int64_t V, int64_t tok, const int dtype) {
    const int64_t V8 = V - V % LANES;
    float top = -INFINITY, lanes[LANES] = {0};
    int bad = 0;
    for (int64_t j = 0; j < V; ++j) {
        const float v = load1(x, j, dtype);
        bad |= v != v;
        top = v > top ? v : top;
    }
    if (bad || isinf(top)) return NAN;
    for (int64_t j = 0; j < V8; ++j) lanes[j % LANES] += exp_score(load1(x, j, dtype) - top);
    float sum = fold8(lanes);
    for (int64_t j = V8; j < V; ++j) sum += exp_score(load1(x, j, dtype) - top);
    return (load1(x, tok, dtype) - top) - logf(sum);
}
#endif

int cbgen_parity_token_logprobs(const void *x, int64_t xs, int64_t rows, int64_t V, const int64_t *tok, float *out,
                                int dtype) {
    if (rows < 0 || V < 1 || xs < V || (dtype != 0 && dtype != 1) || (rows && (!x || !tok || !out))) return 1;
    for (int64_t r = 0; r < rows; ++r)
        if (tok[r] < 0 || tok[r] >= V) return 2;
    const int64_t esize = dtype == 0 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows * V >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) out[r] = row_logprob((const char *)x + r * xs * esize, V, tok[r], dtype);
    return 0;
}

