/* Paged-KV kernels for CPU: decode attention that reads each cached key and value once, straight
 * from its block, and the KV store through a slot mapping.
 *
 * Why C: the torch path gathers every row's blocks into a padded copy and then runs SDPA over it,
 * so each step reads the whole KV twice and writes it once; at decode, that traffic is about a third
 * of a SmolLM2 step.  Here one task per (row, kv head) streams its blocks once.
 *
 * Built at run time by cbgen/model/cpu_kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes, so no torch headers are compiled.  OpenMP resolves to the libgomp that torch has
 * already loaded (same soname), so both share one thread pool.
 *
 * Layouts (contiguous unless a stride is passed):
 *   q              [B, H, D], rows q_stride elements apart
 *   out            [B, H, D]
 *   k/v cache      [num_blocks, block_size, Hkv, D]
 *   block_table    [B, table_stride] int32
 *   seq_lens       [B] int32, context length including the new token
 *   key/value      [T, Hkv, D], rows key_stride/value_stride apart (store), slot_mapping [T] int64,
 *                  -1 = write nowhere
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen_numerics.h"

/* A run of n elements of the cache or query as float32: in place for float32, converted into buf
 * for bfloat16. */
static inline const float *as_f32(const void *base, int64_t off, int n, int dtype, float *buf) {
    if (dtype == 0) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
#pragma omp simd
    for (int i = 0; i < n; ++i) {
        uint32_t bits = ((uint32_t)src[i]) << 16;
        memcpy(&buf[i], &bits, sizeof(float));
    }
    return buf;
}

/* Attention of row b's new token, query heads of kv heads [h0, h1).  Tokens are walked block by
 * block, and every head of a token is read in one contiguous run, so the cache streams in order. */
static void decode_task(const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t n,
                        int64_t b, int h0, int h1, int H, int Hkv, int D, int bs, float scale,
                        int64_t window, float softcap, int dtype, void *out, float *ws, int64_t cap) {
    const int G = H / Hkv, nh = h1 - h0, R = nh * G; /* R query heads in this task */
    const int64_t tok_stride = (int64_t)Hkv * D;
    const int64_t start = (window > 0 && n > window) ? n - window : 0;
    float *qf = ws, *acc = qf + (size_t)R * D, *rowbuf = acc + (size_t)R * D, *scores = rowbuf + (size_t)nh * D;
    const float *qsrc = as_f32(q, b * qs + (int64_t)h0 * G * D, R * D, dtype, qf);
    for (int i = 0; i < R * D; ++i) qf[i] = qsrc[i] * scale;
    int kv_of[512];
    for (int r = 0; r < R && r < 512; ++r) kv_of[r] = r / G;

    for (int pass = 0; pass < 2; ++pass) {
        const void *cache = pass == 0 ? kc : vc;
        if (pass == 1) memset(acc, 0, sizeof(float) * (size_t)R * D);
        for (int64_t j = start; j < n;) {
            const int64_t off = j % bs, cnt = (bs - off) < (n - j) ? (bs - off) : (n - j);
            const int64_t first = ((int64_t)table[j / bs] * bs + off) * tok_stride + (int64_t)h0 * D;
            for (int64_t t = 0; t < cnt; ++t, ++j) {
                const float *row = as_f32(cache, first + t * tok_stride, nh * D, dtype, rowbuf);
                /* Nested over (kv head, query head of its group): an r / G here costs a division per
                 * head and token, which was most of the kernel's time. */
                for (int r = 0; r < R; ++r) {
                    const float *x = row + (int64_t)kv_of[r] * D;
                    if (pass == 0) {
                        const float *qr = qf + (size_t)r * D;
                        float s = 0.f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < D; ++d) s += qr[d] * x[d];
                        if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                        scores[(size_t)r * cap + (j - start)] = s;
                    } else {
                        const float p = scores[(size_t)r * cap + (j - start)];
                        float *ar = acc + (size_t)r * D;
#pragma omp simd
                        for (int d = 0; d < D; ++d) ar[d] += p * x[d];
                    }
                }
            }
        }
        if (pass == 0) {
            const int64_t L = n - start;
            for (int r = 0; r < R; ++r) {
                float *sr = scores + (size_t)r * cap;
                float m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
                for (int64_t i = 0; i < L; ++i) m = sr[i] > m ? sr[i] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < L; ++i) {
                    sr[i] = exp_approx(sr[i] - m);
                    sum += sr[i];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t i = 0; i < L; ++i) sr[i] *= inv;
            }
        }
    }
    const int64_t o = (b * H + (int64_t)h0 * G) * D;
    if (dtype == 0) {
        memcpy((float *)out + o, acc, sizeof(float) * (size_t)R * D);
    } else {
        for (int i = 0; i < R * D; ++i) ((uint16_t *)out)[o + i] = f32_to_bf16(acc[i]);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* In place: s = softmax(s) over n values. */
static inline void softmax16(float *s, int64_t n) {
    if (n <= 0) return;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    if (n - i) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (n - i) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), m));
        _mm512_mask_storeu_ps(s + i, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    if (n - i) _mm512_mask_storeu_ps(s + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), inv));
}

/* r[j] = sum of v[j]'s 16 lanes, for 16 vectors at once: an add tree over in-register transposes
 * (45 instructions for 16 sums, against ~8 dependent ones for each sum reduced on its own). */
static inline __attribute__((always_inline)) __m512 hsum16x16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; ++k) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) { /* per 128-bit lane: that lane's sums of 4 vectors */
        const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* then across the four 128-bit lanes, twice */
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* decode_task for D % 16 == 0 (D <= 256) with AVX-512.  Per kv head, the keys (then the values) are
 * walked block by block; each block's rows are read from memory once and then serve every query
 * head of the task from L1.  Scores are computed 16 tokens at a time and reduced together
 * (hsum16x16); with AVX512-BF16 and D % 32 == 0, bf16 queries and keys go straight into vdpbf16ps
 * (exact bf16 products, float32 sums) instead of being widened first.  The value pass keeps a
 * head's output accumulator in registers through a block.  No division per token or block.
 * ws: R*D scaled queries, R*D accumulators, R*cap scores (R = the task's query heads). */
static inline __attribute__((always_inline)) void decode_task_avx512(
    const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t b, int h0,
    int h1, int H, int Hkv, const int D, int bs, float scale, int64_t window, float softcap, const int dtype,
    void *out, float *ws, int64_t cap) {
    const int G = H / Hkv, nv = D / 16, R = (h1 - h0) * G; /* R query heads in this task */
#if defined(__AVX512BF16__)
    const int pairs = dtype == 1 && D % 32 == 0;
#else
    const int pairs = 0;
#endif
    const int64_t tok_stride = (int64_t)Hkv * D, esize = dtype == 0 ? 4 : 2;
    const int64_t start = (window > 0 && n > window) ? n - window : 0, L = n - start;
    const int64_t q0 = (b * H + (int64_t)h0 * G) * D, qo = b * qs + (int64_t)h0 * G * D;
    float *qf = ws, *acc = ws + (size_t)R * D, *scores = acc + (size_t)R * D; /* scores: R rows of cap */
    if (!pairs)
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < nv; ++i)
                _mm512_storeu_ps(qf + r * D + i * 16,
                                 _mm512_mul_ps(ld16(q, qo + r * D + i * 16, dtype), _mm512_set1_ps(scale)));
    /* Blocks are the outer loop and heads the inner one, so each block (contiguous tokens x heads) is
     * read front to back, once; the next block is prefetched, as its address is a table lookup no
     * hardware prefetcher can guess. */
    for (int pass = 0; pass < 2; ++pass) {
        const void *cache = pass == 0 ? kc : vc;
        const int64_t span = (int64_t)(h1 - h0) * D * esize; /* bytes of this task's heads per token */
        for (int64_t j = start, blk = start / bs, off = start % bs; j < n; ++blk, off = 0) {
            const int64_t cnt = (bs - off) < (n - j) ? (bs - off) : (n - j);
            const int64_t first = ((int64_t)table[blk] * bs + off) * tok_stride;
            if (j + cnt < n) {
                const char *nxt = (const char *)cache + ((int64_t)table[blk + 1] * bs * tok_stride + (int64_t)h0 * D) * esize;
                const int64_t ncnt = (n - j - cnt) < bs ? (n - j - cnt) : bs;
                for (int64_t t = 0; t < ncnt; ++t)
                    for (int64_t c = 0; c < span; c += 64) _mm_prefetch(nxt + t * tok_stride * esize + c, _MM_HINT_T0);
            }
            if (pass == 0) {
                for (int64_t t0 = 0; t0 < cnt; t0 += 16) {
                    const int m = (cnt - t0) < 16 ? (int)(cnt - t0) : 16;
                    int64_t row[16]; /* rows past the block's end repeat its last row; their lanes are dropped */
                    for (int t = 0; t < 16; ++t) row[t] = first + (t0 + (t < m ? t : m - 1)) * tok_stride;
                    for (int r = 0; r < R; ++r) {
                        const int64_t hd = (int64_t)(h0 + r / G) * D;
                        __m512 sv[16];
                        for (int t = 0; t < 16; ++t) sv[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
                        if (pairs) {
                            const uint16_t *qh = (const uint16_t *)q + qo + r * D, *kh = (const uint16_t *)kc + hd;
                            for (int i = 0; i < D; i += 32) {
                                const __m512bh qb = (__m512bh)_mm512_loadu_si512(qh + i);
                                for (int t = 0; t < 16; ++t)
                                    sv[t] = _mm512_dpbf16_ps(sv[t], qb, (__m512bh)_mm512_loadu_si512(kh + row[t] + i));
                            }
                        } else
#endif
                        {
                            for (int i = 0; i < nv; ++i) {
                                const __m512 qv = _mm512_loadu_ps(qf + r * D + i * 16);
                                for (int t = 0; t < 16; ++t)
                                    sv[t] = _mm512_fmadd_ps(qv, ld16(kc, row[t] + hd + i * 16, dtype), sv[t]);
                            }
                        }
                        __m512 sc = hsum16x16(sv);
                        if (pairs) sc = _mm512_mul_ps(sc, _mm512_set1_ps(scale));
                        float *sg = scores + (size_t)r * cap + (j - start) + t0;
                        _mm512_mask_storeu_ps(sg, (__mmask16)((1u << m) - 1u), sc);
                        if (softcap > 0.f)
                            for (int t = 0; t < m; ++t) sg[t] = tanhf(sg[t] / softcap) * softcap;
                    }
                }
            } else {
                for (int r = 0; r < R; ++r) {
                    const int64_t hd = (int64_t)(h0 + r / G) * D;
                    const float *pg = scores + (size_t)r * cap + (j - start);
                    float *ar = acc + r * D;
                    if (nv <= 4) {
                        /* Small heads: four accumulator sets over alternating tokens, so the FMA
                         * latency chain of a single set (one token per 4 cycles) does not bound it. */
                        __m512 a[4][4];
                        for (int u = 0; u < 4; ++u)
                            for (int i = 0; i < nv; ++i) a[u][i] = u ? _mm512_setzero_ps() : _mm512_loadu_ps(ar + i * 16);
                        int64_t t = 0;
                        for (; t + 4 <= cnt; t += 4)
                            for (int u = 0; u < 4; ++u) {
                                const int64_t o = first + (t + u) * tok_stride + hd;
                                const __m512 pv = _mm512_set1_ps(pg[t + u]);
                                for (int i = 0; i < nv; ++i)
                                    a[u][i] = _mm512_fmadd_ps(pv, ld16(vc, o + i * 16, dtype), a[u][i]);
                            }
                        for (; t < cnt; ++t) {
                            const int64_t o = first + t * tok_stride + hd;
                            const __m512 pv = _mm512_set1_ps(pg[t]);
                            for (int i = 0; i < nv; ++i) a[0][i] = _mm512_fmadd_ps(pv, ld16(vc, o + i * 16, dtype), a[0][i]);
                        }
                        for (int i = 0; i < nv; ++i)
                            _mm512_storeu_ps(ar + i * 16, _mm512_add_ps(_mm512_add_ps(a[0][i], a[1][i]),
                                                                        _mm512_add_ps(a[2][i], a[3][i])));
                    } else {
                        __m512 av[16];
                        for (int i = 0; i < nv; ++i) av[i] = _mm512_loadu_ps(ar + i * 16);
                        for (int64_t t = 0; t < cnt; ++t) {
                            const int64_t o = first + t * tok_stride + hd;
                            const __m512 pv = _mm512_set1_ps(pg[t]);
                            for (int i = 0; i < nv; ++i) av[i] = _mm512_fmadd_ps(pv, ld16(vc, o + i * 16, dtype), av[i]);
                        }
                        for (int i = 0; i < nv; ++i) _mm512_storeu_ps(ar + i * 16, av[i]);
                    }
                }
            }
            j += cnt;
        }
        if (pass == 0) {
            for (int r = 0; r < R; ++r) softmax16(scores + (size_t)r * cap, L);
            memset(acc, 0, sizeof(float) * (size_t)R * D);
        }
    }
    if (dtype == 0) {
        memcpy((float *)out + q0, acc, sizeof(float) * (size_t)R * D);
    } else {
        for (int i = 0; i < R * D; ++i) ((uint16_t *)out)[q0 + i] = f32_to_bf16(acc[i]);
    }
}

/* Specialised copies for the common head sizes and both dtypes, so the D loops unroll. */
static void decode_task_fast(const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t n,
                             int64_t b, int h0, int h1, int H, int Hkv, int D, int bs, float scale,
                             int64_t window, float softcap, int dtype, void *out, float *ws, int64_t cap) {
#define CB_CALL(DD, DT) \
    decode_task_avx512(q, qs, kc, vc, table, n, b, h0, h1, H, Hkv, DD, bs, scale, window, softcap, DT, out, ws, cap)
    if (dtype == 0) {
        if (D == 64) CB_CALL(64, 0);
        else if (D == 128) CB_CALL(128, 0);
        else if (D == 16) CB_CALL(16, 0);
        else if (D == 32) CB_CALL(32, 0);
        else CB_CALL(D, 0);
    } else {
        if (D == 64) CB_CALL(64, 1);
        else if (D == 128) CB_CALL(128, 1);
        else if (D == 16) CB_CALL(16, 1);
        else if (D == 32) CB_CALL(32, 1);
        else CB_CALL(D, 1);
    }
#undef CB_CALL
}
#define CB_HAVE_FAST 1
#else
#define CB_HAVE_FAST 0
#endif

/* Whether every row's context fits its block-table row (table_width entries) and every block it
 * reads is a block of the cache: checked before any KV is touched, so a bad table is an error, never
 * a read past the cache. */
static int tables_in_range(const int32_t *block_table, int64_t table_stride, int64_t table_width,
                           const int32_t *seq_lens, int64_t B, int bs, int64_t num_blocks) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t len = seq_lens[b];
        if (len < 0 || len > table_width * bs) return 0;
        const int32_t *row = block_table + b * table_stride;
        for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
            if (row[j] < 0 || row[j] >= num_blocks) return 0;
    }
    return 1;
}

/* impl: 0 = the fastest this build has, 1 = the portable loops (tests compare the two).
 * Returns 0, 1 for bad sizes, 3 when out of memory, 4 for a block table or length outside the cache. */
int cbgen_paged_decode(const void *q, int64_t q_stride, const void *kc, const void *vc, const int32_t *block_table,
                       int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int64_t B,
                       int H, int Hkv, int D, int bs, int64_t num_blocks, float scale, int64_t window, float softcap,
                       int dtype, int impl) {
    if (Hkv <= 0 || H % Hkv != 0 || dtype < 0 || dtype > 1 || H > 512 || D <= 0 || bs <= 0) return 1;
    if (!tables_in_range(block_table, table_stride, table_width, seq_lens, B, bs, num_blocks)) return 4;
    const int fast = CB_HAVE_FAST && impl == 0 && D % 16 == 0 && D <= 256;
    (void)fast; /* unused in builds without AVX-512 */
    /* Whole rows per task when there are enough rows to keep every thread busy (sequential reads);
     * otherwise one task per kv head. */
    const int split = B >= 16 ? 1 : Hkv;
    const int per = Hkv / split, G = H / Hkv;
    int64_t cap = 1; /* longest context: the score buffer's row length */
    for (int64_t b = 0; b < B; ++b) cap = seq_lens[b] > cap ? seq_lens[b] : cap;
    int failed = 0;
#pragma omp parallel
    {
        float *ws = (float *)malloc(sizeof(float) * ((size_t)per * G * (2 * D + cap) + (size_t)per * D));
        if (!ws) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * split; ++task) {
            if (!ws) continue;
            const int64_t b = task / split;
            const int h0 = (int)(task % split) * per;
#if CB_HAVE_FAST
            if (fast) {
                decode_task_fast(q, q_stride, kc, vc, block_table + b * table_stride, seq_lens[b], b, h0, h0 + per, H,
                                 Hkv, D, bs, scale, window, softcap, dtype, out, ws, cap);
                continue;
            }
#endif
            decode_task(q, q_stride, kc, vc, block_table + b * table_stride, seq_lens[b], b, h0, h0 + per, H, Hkv, D,
                        bs, scale, window, softcap, dtype, out, ws, cap);
        }
        free(ws);
    }
    return failed ? 3 : 0;
}

/* Copies each token's keys and values ([Hkv * D] contiguous elements; rows `*_stride` elements apart)
 * into its slot (-1: nowhere).  Returns 2, writing nothing, if a slot lies outside the cache's
 * num_slots. */
int cbgen_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                   void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems, int elem_size,
                   int64_t num_slots) {
    for (int64_t t = 0; t < T; ++t)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return 2;
    const size_t row_bytes = (size_t)row_elems * elem_size;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row_bytes, (const char *)key + t * key_stride * elem_size, row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)value + t * value_stride * elem_size, row_bytes);
    }
    return 0;
}
