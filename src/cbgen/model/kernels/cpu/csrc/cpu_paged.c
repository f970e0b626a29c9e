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
 *   out            [B, H, Dv]
 *   k cache        [num_blocks, block_size, Hkv, D]
 *   v cache        [num_blocks, block_size, Hkv, Dv] (Dv != D: latent attention's expanded keys and
 *                  values; only the portable loops take that)
 *   block_table    [B, table_stride] int32
 *   seq_lens       [B] int32, context length including the new token
 *   key/value      [T, Hkv, D] / [T, Hkv, Dv], rows key_stride/value_stride apart (store), slot_mapping [T] int64,
 *                  -1 = write nowhere
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#include "cbgen_numerics.h"
#include "cbgen_paged.h"

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

/* One task's share of the attention of row b's new token: query heads of kv heads [h0, h1) over the
 * context tokens [j0, j1).  It leaves softmax unnormalised: part holds the R running maxima, the R
 * sums of exp(score - max) and the R x D weighted value sums, so the tasks that split one row's
 * context can be merged (merge_parts).  Tokens are walked block by block, and every head of a token
 * is read in one contiguous run, so the cache streams in order. */
static void decode_task(const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t j0,
                        int64_t j1, int64_t b, int h0, int h1, int H, int Hkv, int D, int Dv, int bs, float scale,
                        float softcap, int dtype, float *part, float *ws, int64_t cap) {
    const int G = H / Hkv, nh = h1 - h0, R = nh * G; /* R query heads in this task */
    const int Dm = D > Dv ? D : Dv;
    float *qf = ws, *rowbuf = qf + (size_t)R * D, *scores = rowbuf + (size_t)nh * Dm;
    float *acc = part + 2 * R;
    const float *qsrc = as_f32(q, b * qs + (int64_t)h0 * G * D, R * D, dtype, qf);
    for (int i = 0; i < R * D; ++i) qf[i] = qsrc[i] * scale;
    int kv_of[512];
    for (int r = 0; r < R && r < 512; ++r) kv_of[r] = r / G;

    for (int pass = 0; pass < 2; ++pass) {
        const void *cache = pass == 0 ? kc : vc;
        const int W = pass == 0 ? D : Dv; /* this pass's head size */
        const int64_t tok_stride = (int64_t)Hkv * W;
        if (pass == 1) memset(acc, 0, sizeof(float) * (size_t)R * Dv);
        for (int64_t j = j0; j < j1;) {
            const int64_t off = j % bs, cnt = (bs - off) < (j1 - j) ? (bs - off) : (j1 - j);
            const int64_t first = ((int64_t)table[j / bs] * bs + off) * tok_stride + (int64_t)h0 * W;
            for (int64_t t = 0; t < cnt; ++t, ++j) {
                const float *row = as_f32(cache, first + t * tok_stride, nh * W, dtype, rowbuf);
                /* Nested over (kv head, query head of its group): an r / G here costs a division per
                 * head and token, which was most of the kernel's time. */
                for (int r = 0; r < R; ++r) {
                    const float *x = row + (int64_t)kv_of[r] * W;
                    if (pass == 0) {
                        const float *qr = qf + (size_t)r * D;
                        float s = 0.f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < D; ++d) s += qr[d] * x[d];
                        if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                        scores[(size_t)r * cap + (j - j0)] = s;
                    } else {
                        const float p = scores[(size_t)r * cap + (j - j0)];
                        float *ar = acc + (size_t)r * Dv;
#pragma omp simd
                        for (int d = 0; d < Dv; ++d) ar[d] += p * x[d];
                    }
                }
            }
        }
        if (pass == 0) {
            const int64_t L = j1 - j0;
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
                part[r] = m;
                part[R + r] = sum;
            }
        }
    }
}

/* A software prefetch spread over a block's work: the lines of a later block (this task's heads,
 * `lpt` lines a token, tokens `tstride` bytes apart), `per` lines each time pf_step is called.  On an
 * AMD EPYC with AVX2 only, prefetching the whole next block in one burst at the block's start stalled
 * the core on its fill buffers while the memory then sat idle through the compute: a single 8k-token
 * sequence's attention ran at 8 GB/s of KV; spread over the block's steps it runs at 14 (read
 * bandwidth 21).  Where the lines go is the caller's (l2): non-temporal into L1 was 3-10% faster
 * than into every cache level on that EPYC; on a Zen 4 (AMD EPYC family 25 model 17) into L2 only
 * (prefetcht1) was 20-35% faster than non-temporal, the L1's fill buffers being what ran out.  The
 * engine measures both at start (cbgen.model.cpu_fast.decode_loops). */
typedef struct {
    const char *base;
    int64_t next, lines, lpt, tstride;
    int per, contiguous; /* contiguous: the lines follow one another (a task of every kv head) */
    int l2;              /* 1: prefetcht1 (into L2), 0: prefetchnta */
} pf_cursor;

static inline __attribute__((always_inline)) void pf_step(pf_cursor *c) {
    for (int i = 0; i < c->per && c->next < c->lines; ++i, ++c->next) {
        const char *line = c->contiguous ? c->base + c->next * 64
                                         : c->base + (c->next / c->lpt) * c->tstride + (c->next % c->lpt) * 64;
        if (c->l2) __builtin_prefetch(line, 0, 2);
        else __builtin_prefetch(line, 0, 0);
    }
}

/* The cursor over tokens [ks, ke) of block-table entry kb (their own block) of `cache`, heads from h0
 * (`span` bytes a token), spread over `steps` calls of pf_step. */
static inline pf_cursor pf_block(const void *cache, const int32_t *table, int64_t kb, int64_t ks, int64_t ke, int bs,
                                 int64_t tok_stride, int h0, int D, int64_t esize, int64_t span, int64_t steps,
                                 int l2) {
    pf_cursor c;
    c.l2 = l2;
    c.base = (const char *)cache + (((int64_t)table[kb] * bs + ks % bs) * tok_stride + (int64_t)h0 * D) * esize;
    c.lpt = (span + 63) / 64;
    c.tstride = tok_stride * esize;
    c.lines = (ke - ks) * c.lpt;
    c.next = 0;
    c.per = (int)((c.lines + steps - 1) / (steps > 0 ? steps : 1));
    c.contiguous = c.lpt * 64 == c.tstride;
    return c;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* In place: s = exp(s - max s) over n values; returns the max and the sum of the exponentials. */
static inline void expsum16(float *s, int64_t n, float *max_out, float *sum_out) {
    *max_out = -INFINITY;
    *sum_out = 0.f;
    if (n <= 0) return;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    if (n - i) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + i));
    const float mx = _mm512_reduce_max_ps(mv);
    const __m512 m = _mm512_set1_ps(mx);
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
    *max_out = mx;
    *sum_out = _mm512_reduce_add_ps(sum);
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

/* The AVX-512 value pass takes the query rows of one kv head up to GROUP16 at a time, so each value
 * vector is loaded (and, for bfloat16, widened) once for all of them.  One row at a time, the
 * widening of every value vector for each of a GQA group's heads was most of the pass. */
enum { GROUP16 = 4 };

/* How many query rows from row r0 on share its kv head and go together (rows are kv-head major). */
static inline int gb16_step(int r0, int G) {
    const int left = G - r0 % G;
    return left < GROUP16 ? left : GROUP16;
}

/* acc rows g < gb (ar + g * D) += sum over cnt tokens of p[g][t] * value[t], p[g] at pg + g * cap;
 * 4 value vectors (64 elements) of a token at a time, each loaded once for the gb rows (up to 16
 * accumulators: as many independent FMA chains as the latency needs). */
static inline __attribute__((always_inline)) void group_values16(const float *pg, int64_t cap, float *ar, const int D,
                                                                 const void *vc, int64_t first, int64_t tok_stride,
                                                                 int64_t hd, int64_t cnt, const int dtype,
                                                                 const int gb, pf_cursor *pf) {
    for (int i0 = 0; i0 < D / 16; i0 += 4) {
        const int w = (D / 16 - i0) < 4 ? D / 16 - i0 : 4;
        __m512 a[GROUP16][4];
        for (int g = 0; g < gb; ++g)
            for (int i = 0; i < w; ++i) a[g][i] = _mm512_loadu_ps(ar + g * D + (i0 + i) * 16);
        for (int64_t t = 0; t < cnt; ++t) {
            const int64_t o = first + t * tok_stride + hd + i0 * 16;
            pf_step(pf);
            __m512 p[GROUP16];
            for (int g = 0; g < gb; ++g) p[g] = _mm512_set1_ps(pg[g * cap + t]);
            for (int i = 0; i < w; ++i) {
                const __m512 v = ld16(vc, o + i * 16, dtype);
                for (int g = 0; g < gb; ++g) a[g][i] = _mm512_fmadd_ps(p[g], v, a[g][i]);
            }
        }
        for (int g = 0; g < gb; ++g)
            for (int i = 0; i < w; ++i) _mm512_storeu_ps(ar + g * D + (i0 + i) * 16, a[g][i]);
    }
}

/* decode_task for D % 16 == 0 (D <= 256) with AVX-512.  Per kv head, the keys (then the values) are
 * walked block by block; each block's rows are read from memory once and then serve every query
 * head of the task from L1.  Scores are computed 16 tokens at a time and reduced together
 * (hsum16x16); with AVX512-BF16 and D % 32 == 0, bf16 queries and keys go straight into vdpbf16ps
 * (exact bf16 products, float32 sums) instead of being widened first.  The value pass takes a
 * GQA group's query heads together (group_values16), their accumulators in registers through a
 * block; with one query head per kv head it keeps four accumulator sets over alternating tokens.
 * ws: R*D scaled queries, R*D accumulators, R*cap scores (R = the task's query heads). */
static inline __attribute__((always_inline)) void decode_task_avx512(
    const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t j0, int64_t j1,
    int64_t b, int h0, int h1, int H, int Hkv, const int D, int bs, float scale, float softcap, const int dtype,
    float *part, float *ws, int64_t cap, const int l2) {
    const int G = H / Hkv, nv = D / 16, R = (h1 - h0) * G; /* R query heads in this task */
#if defined(__AVX512BF16__)
    const int pairs = dtype == 1 && D % 32 == 0;
#else
    const int pairs = 0;
#endif
    const int64_t tok_stride = (int64_t)Hkv * D, esize = dtype == 0 ? 4 : 2;
    const int64_t L = j1 - j0, qo = b * qs + (int64_t)h0 * G * D;
    float *qf = ws, *scores = ws + (size_t)2 * R * D, *acc = part + 2 * R; /* scores: R rows of cap */
    if (!pairs)
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < nv; ++i)
                _mm512_storeu_ps(qf + r * D + i * 16,
                                 _mm512_mul_ps(ld16(q, qo + r * D + i * 16, dtype), _mm512_set1_ps(scale)));
    /* Blocks are the outer loop and heads the inner one, so each block (contiguous tokens x heads) is
     * read front to back, once.  The next block in walk order (keys, then values) is prefetched
     * spread over this block's work, as the AVX2 loops do: its address is a table lookup no hardware
     * prefetcher can guess, and on a Zen 4 one burst at the block's start left these loops 26% slower
     * than the AVX2 ones on cold caches. */
    const int64_t b0 = j0 / bs, nblk = (j1 - 1) / bs - b0 + 1;
    const int64_t span = (int64_t)(h1 - h0) * D * esize; /* bytes of this task's heads per token */
    int groups = 0;
    for (int r0 = 0; r0 < R; r0 += gb16_step(r0, G)) ++groups;
    for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j = j0, blk = j0 / bs, off = j0 % bs; j < j1; ++blk, off = 0) {
            const int64_t cnt = (bs - off) < (j1 - j) ? (bs - off) : (j1 - j);
            const int64_t first = ((int64_t)table[blk] * bs + off) * tok_stride;
            pf_cursor pf = {0, 0, 0, 1, 0, 0, 1};
            const int64_t k = pass * nblk + (blk - b0) + 1;
            if (k < 2 * nblk) {
                const int64_t kb = k % nblk + b0, ks = kb == b0 ? j0 : kb * bs;
                const int64_t ke = (kb + 1) * bs < j1 ? (kb + 1) * bs : j1;
                const int64_t steps = pass == 0 ? R * ((cnt + 15) / 16)
                                      : G > 1 ? groups * ((nv + 3) / 4) * cnt
                                              : R * cnt;
                pf = pf_block(k < nblk ? kc : vc, table, kb, ks, ke, bs, tok_stride, h0, D, esize, span, steps, l2);
            }
            if (pass == 0) {
                for (int64_t t0 = 0; t0 < cnt; t0 += 16) {
                    const int m = (cnt - t0) < 16 ? (int)(cnt - t0) : 16;
                    int64_t row[16]; /* rows past the block's end repeat its last row; their lanes are dropped */
                    for (int t = 0; t < 16; ++t) row[t] = first + (t0 + (t < m ? t : m - 1)) * tok_stride;
                    for (int r = 0; r < R; ++r) {
                        const int64_t hd = (int64_t)(h0 + r / G) * D;
                        pf_step(&pf);
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
                        float *sg = scores + (size_t)r * cap + (j - j0) + t0;
                        _mm512_mask_storeu_ps(sg, (__mmask16)((1u << m) - 1u), sc);
                        if (softcap > 0.f)
                            for (int t = 0; t < m; ++t) sg[t] = tanhf(sg[t] / softcap) * softcap;
                    }
                }
            } else if (G > 1) {
                for (int r0 = 0; r0 < R; r0 += gb16_step(r0, G)) {
                    const int gb = gb16_step(r0, G);
                    const int64_t hd = (int64_t)(h0 + r0 / G) * D;
                    const float *pg = scores + (size_t)r0 * cap + (j - j0);
#define CB_VALUES16(GB) group_values16(pg, cap, acc + r0 * D, D, vc, first, tok_stride, hd, cnt, dtype, GB, &pf)
                    if (gb == 4) CB_VALUES16(4);
                    else if (gb == 3) CB_VALUES16(3);
                    else CB_VALUES16(2);
#undef CB_VALUES16
                }
            } else {
                for (int r = 0; r < R; ++r) {
                    const int64_t hd = (int64_t)(h0 + r) * D;
                    const float *pg = scores + (size_t)r * cap + (j - j0);
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
                                pf_step(&pf);
                                for (int i = 0; i < nv; ++i)
                                    a[u][i] = _mm512_fmadd_ps(pv, ld16(vc, o + i * 16, dtype), a[u][i]);
                            }
                        for (; t < cnt; ++t) {
                            const int64_t o = first + t * tok_stride + hd;
                            const __m512 pv = _mm512_set1_ps(pg[t]);
                            pf_step(&pf);
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
                            pf_step(&pf);
                            for (int i = 0; i < nv; ++i) av[i] = _mm512_fmadd_ps(pv, ld16(vc, o + i * 16, dtype), av[i]);
                        }
                        for (int i = 0; i < nv; ++i) _mm512_storeu_ps(ar + i * 16, av[i]);
                    }
                }
            }
            j += cnt;
        }
        if (pass == 0) {
            for (int r = 0; r < R; ++r) expsum16(scores + (size_t)r * cap, L, part + r, part + R + r);
            memset(acc, 0, sizeof(float) * (size_t)R * D);
        }
    }
}

/* Specialised copies for the common head sizes and both dtypes, so the D loops unroll. */
static void decode_task_fast(const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t j0,
                             int64_t j1, int64_t b, int h0, int h1, int H, int Hkv, int D, int bs, float scale,
                             float softcap, int dtype, float *part, float *ws, int64_t cap, int l2) {
#define CB_CALL(DD, DT) \
    decode_task_avx512(q, qs, kc, vc, table, j0, j1, b, h0, h1, H, Hkv, DD, bs, scale, softcap, DT, part, ws, cap, l2)
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

#if defined(__AVX2__) && defined(__FMA__)

/* r[j] = sum of v[j]'s 8 lanes, for 4 vectors at once. */
static inline __attribute__((always_inline)) __m128 hsum4x8(const __m256 v[4]) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* The query rows of one kv head are taken GROUP at a time, so each key and value vector is loaded
 * once for all of them: on an AMD EPYC with AVX2 only the loops were bound by vector loads (a load
 * per FMA while every query row reloaded the keys), not by FMAs or memory bandwidth. */
enum { GROUP = 3 };

/* How many query rows from row r0 on share its kv head and go together (rows are kv-head major). */
static inline int gb_step(int r0, int G) {
    const int left = G - r0 % G;
    return left < GROUP ? left : GROUP;
}

/* Scores of gb (<= GROUP) consecutive query rows (qf, D apart) against cnt tokens from cache element
 * `first` (+ hd, the kv head's offset), 4 tokens at a time; row g's scores go to sg + g * cap. */
static inline __attribute__((always_inline)) void group_scores(const float *qf, const int D, const void *kc,
                                                               int64_t first, int64_t tok_stride, int64_t hd,
                                                               int64_t cnt, float *sg, int64_t cap, float softcap,
                                                               const int dtype, const int gb, pf_cursor *pf) {
    for (int64_t t0 = 0; t0 < cnt; t0 += 4) {
        pf_step(pf);
        const int m = (cnt - t0) < 4 ? (int)(cnt - t0) : 4;
        int64_t row[4]; /* rows past the block's end repeat its last row; their lanes are dropped */
        for (int t = 0; t < 4; ++t) row[t] = first + (t0 + (t < m ? t : m - 1)) * tok_stride + hd;
        __m256 sv[GROUP][4];
        for (int g = 0; g < gb; ++g)
            for (int t = 0; t < 4; ++t) sv[g][t] = _mm256_setzero_ps();
        for (int i = 0; i < D / 8; ++i) {
            __m256 qv[GROUP];
            for (int g = 0; g < gb; ++g) qv[g] = _mm256_loadu_ps(qf + g * D + i * 8);
            for (int t = 0; t < 4; ++t) {
                const __m256 kv = ld8(kc, row[t] + i * 8, dtype);
                for (int g = 0; g < gb; ++g) sv[g][t] = _mm256_fmadd_ps(qv[g], kv, sv[g][t]);
            }
        }
        for (int g = 0; g < gb; ++g) {
            float *dst = sg + g * cap + t0;
            if (m == 4 && !(softcap > 0.f)) {
                _mm_storeu_ps(dst, hsum4x8(sv[g]));
            } else {
                float sc[4];
                _mm_storeu_ps(sc, hsum4x8(sv[g]));
                for (int t = 0; t < m; ++t) dst[t] = softcap > 0.f ? tanhf(sc[t] / softcap) * softcap : sc[t];
            }
        }
    }
}

/* acc rows g < gb (ar + g * D) += sum over cnt tokens of p[g][t] * value[t], p[g] at pg + g * cap;
 * 4 value vectors (32 elements) of a token at a time, each loaded once for the gb rows (12
 * accumulators, 3 probabilities and the value: all 16 registers). */
static inline __attribute__((always_inline)) void group_values(const float *pg, int64_t cap, float *ar, const int D,
                                                               const void *vc, int64_t first, int64_t tok_stride,
                                                               int64_t hd, int64_t cnt, const int dtype,
                                                               const int gb, pf_cursor *pf) {
    for (int i0 = 0; i0 < D / 8; i0 += 4) {
        const int w = (D / 8 - i0) < 4 ? D / 8 - i0 : 4;
        __m256 a[GROUP][4];
        for (int g = 0; g < gb; ++g)
            for (int i = 0; i < w; ++i) a[g][i] = _mm256_loadu_ps(ar + g * D + (i0 + i) * 8);
        for (int64_t t = 0; t < cnt; ++t) {
            const int64_t o = first + t * tok_stride + hd + i0 * 8;
            pf_step(pf);
            __m256 p[GROUP];
            for (int g = 0; g < gb; ++g) p[g] = _mm256_broadcast_ss(pg + g * cap + t);
            for (int i = 0; i < w; ++i) {
                const __m256 v = ld8(vc, o + i * 8, dtype);
                for (int g = 0; g < gb; ++g) a[g][i] = _mm256_fmadd_ps(p[g], v, a[g][i]);
            }
        }
        for (int g = 0; g < gb; ++g)
            for (int i = 0; i < w; ++i) _mm256_storeu_ps(ar + g * D + (i0 + i) * 8, a[g][i]);
    }
}

/* The group functions with gb a constant (so their arrays are registers). */
#define CB_GROUPS(call)                                                                                                \
    do {                                                                                                               \
        if (gb == 3) call(3);                                                                                          \
        else if (gb == 2) call(2);                                                                                     \
        else call(1);                                                                                                  \
    } while (0)

/* decode_task for D % 8 == 0 (D <= 256) with AVX2 + FMA: a kv head's query rows GROUP at a time,
 * over 4 tokens for the scores and over 32 value elements for the values, accumulators in registers
 * through a block.  On a CPU without AVX-512 the portable loops ran at ~2 GB/s of KV, a tenth of the
 * memory bandwidth, which made an 8k-token decode step mostly attention.  ws: R*D scaled queries,
 * then R*cap scores. */
static inline __attribute__((always_inline)) void decode_task_avx2(
    const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table, int64_t j0, int64_t j1,
    int64_t b, int h0, int h1, int H, int Hkv, const int D, int bs, float scale, float softcap, const int dtype,
    float *part, float *ws, int64_t cap, const int l2) {
    const int G = H / Hkv, nv = D / 8, R = (h1 - h0) * G;
    const int64_t tok_stride = (int64_t)Hkv * D, esize = dtype == 0 ? 4 : 2, L = j1 - j0;
    const int64_t qo = b * qs + (int64_t)h0 * G * D;
    float *qf = ws, *scores = ws + (size_t)R * D, *acc = part + 2 * R;
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < nv; ++i)
            _mm256_storeu_ps(qf + r * D + i * 8, _mm256_mul_ps(ld8(q, qo + r * D + i * 8, dtype), _mm256_set1_ps(scale)));
    /* The task's blocks b0 .. b0 + nblk - 1, walked once for the keys and once for the values; groups:
     * the (kv head, query rows) steps a block takes. */
    const int64_t b0 = j0 / bs, nblk = (j1 - 1) / bs - b0 + 1;
    int groups = 0;
    for (int r0 = 0; r0 < R; r0 += gb_step(r0, G)) ++groups;
    for (int pass = 0; pass < 2; ++pass) {
        const int64_t span = (int64_t)(h1 - h0) * D * esize;
        for (int64_t j = j0, blk = j0 / bs, off = j0 % bs; j < j1; ++blk, off = 0) {
            const int64_t cnt = (bs - off) < (j1 - j) ? (bs - off) : (j1 - j);
            const int64_t first = ((int64_t)table[blk] * bs + off) * tok_stride;
            /* Prefetch the task's next block in walk order (the first value block after the last key
             * block), spread over this block's steps. */
            pf_cursor pf = {0, 0, 0, 1, 0, 0, 1};
            const int64_t k = pass * nblk + (blk - b0) + 1;
            if (k < 2 * nblk) {
                const int64_t kb = k % nblk + b0, ks = kb == b0 ? j0 : kb * bs;
                const int64_t ke = (kb + 1) * bs < j1 ? (kb + 1) * bs : j1;
                const int64_t steps = pass == 0 ? groups * ((cnt + 3) / 4) : groups * ((nv + 3) / 4) * cnt;
                pf = pf_block(k < nblk ? kc : vc, table, kb, ks, ke, bs, tok_stride, h0, D, esize, span, steps, l2);
            }
            if (pass == 0) {
                for (int r0 = 0; r0 < R; r0 += gb_step(r0, G)) {
                    const int gb = gb_step(r0, G);
                    const int64_t hd = (int64_t)(h0 + r0 / G) * D;
                    float *sg = scores + (size_t)r0 * cap + (j - j0);
#define CB_SCORES(GB) group_scores(qf + r0 * D, D, kc, first, tok_stride, hd, cnt, sg, cap, softcap, dtype, GB, &pf)
                    CB_GROUPS(CB_SCORES);
#undef CB_SCORES
                }
            } else {
                for (int r0 = 0; r0 < R; r0 += gb_step(r0, G)) {
                    const int gb = gb_step(r0, G);
                    const int64_t hd = (int64_t)(h0 + r0 / G) * D;
                    const float *pg = scores + (size_t)r0 * cap + (j - j0);
#define CB_VALUES(GB) group_values(pg, cap, acc + r0 * D, D, vc, first, tok_stride, hd, cnt, dtype, GB, &pf)
                    CB_GROUPS(CB_VALUES);
#undef CB_VALUES
                }
            }
            j += cnt;
        }
        if (pass == 0) {
            for (int r = 0; r < R; ++r) {
                float *s = scores + (size_t)r * cap;
                __m256 mv = _mm256_set1_ps(-INFINITY);
                int64_t i = 0;
                for (; i + 8 <= L; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
                float lanes[8], mx = -INFINITY, sum = 0.f;
                _mm256_storeu_ps(lanes, mv);
                for (int k = 0; k < 8; ++k) mx = lanes[k] > mx ? lanes[k] : mx;
                for (int64_t k = i; k < L; ++k) mx = s[k] > mx ? s[k] : mx;
                const __m256 mm = _mm256_set1_ps(mx);
                __m256 sv = _mm256_setzero_ps();
                for (i = 0; i + 8 <= L; i += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mm));
                    _mm256_storeu_ps(s + i, e);
                    sv = _mm256_add_ps(sv, e);
                }
                _mm256_storeu_ps(lanes, sv);
                for (int k = 0; k < 8; ++k) sum += lanes[k];
                for (; i < L; ++i) sum += (s[i] = exp_approx(s[i] - mx));
                part[r] = mx;
                part[R + r] = sum;
            }
            memset(acc, 0, sizeof(float) * (size_t)R * D);
        }
    }
}

static void decode_task_avx2_any(const void *q, int64_t qs, const void *kc, const void *vc, const int32_t *table,
                                 int64_t j0, int64_t j1, int64_t b, int h0, int h1, int H, int Hkv, int D, int bs,
                                 float scale, float softcap, int dtype, float *part, float *ws, int64_t cap, int l2) {
#define CB_CALL(DD, DT) \
    decode_task_avx2(q, qs, kc, vc, table, j0, j1, b, h0, h1, H, Hkv, DD, bs, scale, softcap, DT, part, ws, cap, l2)
    if (dtype == 0) {
        if (D == 64) CB_CALL(64, 0);
        else if (D == 128) CB_CALL(128, 0);
        else CB_CALL(D, 0);
    } else {
        if (D == 64) CB_CALL(64, 1);
        else if (D == 128) CB_CALL(128, 1);
        else CB_CALL(D, 1);
    }
#undef CB_CALL
}
#define CB_HAVE_AVX2 1
#else
#define CB_HAVE_AVX2 0
#endif

/* Which decode loops this build has: bit 0 the AVX-512 ones (what impl 0 runs where they exist), bit 1
 * the AVX2 ones (impl 2).  Which of them is faster is measured at engine start, not assumed: on a
 * Zen 4 (AMD EPYC family 25 model 17, AVX-512, no AMX) the AVX2 loops ran 17-30% faster (decode_loops.py). */
int cbgen_decode_loops(void) { return (CB_HAVE_FAST ? 1 : 0) | (CB_HAVE_AVX2 ? 2 : 0); }

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

/* The chunks of one task's part buffer merged into out[b, heads of the group]: each chunk's sums are
 * rescaled to the largest maximum, then divided by the total weight (an empty context gives zeros). */
static void merge_parts(const float *parts, int64_t chunks, int R, int D, int64_t stride, int dtype, void *out,
                        int64_t o) {
    for (int r = 0; r < R; ++r) {
        float mx = -INFINITY;
        for (int64_t c = 0; c < chunks; ++c) {
            const float *p = parts + c * stride;
            if (p[R + r] > 0.f && p[r] > mx) mx = p[r];
        }
        float acc[2048], total = 0.f; /* D <= 2048, checked on entry */
        for (int d = 0; d < D; ++d) acc[d] = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
            const float *p = parts + c * stride;
            if (!(p[R + r] > 0.f)) continue;
            const float w = chunks == 1 ? 1.f : exp_approx(p[r] - mx);
            total += w * p[R + r];
            const float *a = p + 2 * R + (int64_t)r * D;
            for (int d = 0; d < D; ++d) acc[d] += w * a[d];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        if (dtype == 0) {
            for (int d = 0; d < D; ++d) ((float *)out)[o + (int64_t)r * D + d] = acc[d] * inv;
        } else {
            for (int d = 0; d < D; ++d) ((uint16_t *)out)[o + (int64_t)r * D + d] = f32_to_bf16(acc[d] * inv);
        }
    }
}

/* impl: bits 0-1 pick the loops: 0 = the fastest this build has, 1 = the portable loops, 2 = the AVX2
 * loops (tests compare them; 2 falls back to the portable loops in a build without AVX2).  Bit 2 (4):
 * the vector loops prefetch into L2 rather than non-temporally (pf_cursor).
 * Returns 0, 1 for bad sizes or impl, 3 when out of memory, 4 for a block table or length outside the
 * cache. */
int cbgen_paged_decode(const void *q, int64_t q_stride, const void *kc, const void *vc, const int32_t *block_table,
                       int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int64_t B,
                       int H, int Hkv, int D, int Dv, int bs, int64_t num_blocks, float scale, int64_t window,
                       float softcap, int dtype, int impl) {
    if (Hkv <= 0 || H % Hkv != 0 || dtype < 0 || dtype > 1 || H > 512 || D <= 0 || D > 2048 || bs <= 0) return 1;
    if (Dv <= 0 || Dv > 2048) return 1;
    if (impl < 0 || impl > 7 || (impl & 3) == 3) return 1;
    if (!tables_in_range(block_table, table_stride, table_width, seq_lens, B, bs, num_blocks)) return 4;
    const int l2 = (impl & 4) != 0;
    impl &= 3;
    (void)l2;
    /* The vector loops take one head size for keys and values; other pairs run the portable loops. */
    const int fast = CB_HAVE_FAST && impl == 0 && D % 16 == 0 && D <= 256 && Dv == D;
    const int avx2 = CB_HAVE_AVX2 && (impl == 0 || impl == 2) && !fast && D % 8 == 0 && D <= 256 && Dv == D;
    (void)fast, (void)avx2; /* unused in builds without the vector loops */
    int64_t longest = 1; /* the longest attended context */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = seq_lens[b], L = (window > 0 && n > window) ? window : n;
        longest = L > longest ? L : longest;
    }
    /* Tasks: whole rows (every kv head of a token is one contiguous run, so a task streams its blocks
     * front to back) when there are enough rows, or contexts long enough to cut into chunks, to keep
     * every thread busy; otherwise one task per (row, kv head).  A task per kv head reads a third or
     * less of each cache line run and measured at a third of the memory bandwidth. */
    enum { MIN_CHUNK = 256 };
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    const int split = (B >= want || longest >= 2 * MIN_CHUNK) ? 1 : Hkv;
    const int per = Hkv / split, G = H / Hkv, R = per * G;
    /* Too few tasks to give every thread several: one long sequence would run on one thread.  Then
     * each row's context is cut into chunks (merged after), none shorter than MIN_CHUNK tokens so the
     * merge and the per-task set-up stay small. */
    const int64_t units = B * split;
    int64_t chunks = units >= want ? 1 : (want + units - 1) / units;
    if (chunks > longest / MIN_CHUNK) chunks = longest / MIN_CHUNK > 0 ? longest / MIN_CHUNK : 1;
    const int64_t cap = (longest + chunks - 1) / chunks; /* the score buffer's row length */
    const int64_t stride = (int64_t)R * (Dv + 2);         /* one task's part: maxima, sums, values */
    const int Dm = D > Dv ? D : Dv;
    float *parts = (float *)malloc(sizeof(float) * (size_t)(units * chunks * stride));
    if (!parts) return 3;
    int failed = 0;
#pragma omp parallel
    {
        float *ws = (float *)malloc(sizeof(float) * ((size_t)R * (2 * Dm + cap) + (size_t)per * Dm));
        if (!ws) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < units * chunks; ++task) {
            if (!ws) continue;
            const int64_t b = task / (split * chunks), g = (task / chunks) % split, c = task % chunks;
            const int h0 = (int)g * per;
            const int64_t n = seq_lens[b], start = (window > 0 && n > window) ? n - window : 0;
            const int64_t j0 = start + c * cap < n ? start + c * cap : n;
            const int64_t j1 = j0 + cap < n ? j0 + cap : n;
            float *part = parts + task * stride;
            if (j0 >= j1) {
                for (int r = 0; r < R; ++r) part[r] = -INFINITY, part[R + r] = 0.f;
                continue;
            }
            const int32_t *table = block_table + b * table_stride;
#if CB_HAVE_FAST
            if (fast) {
                decode_task_fast(q, q_stride, kc, vc, table, j0, j1, b, h0, h0 + per, H, Hkv, D, bs, scale, softcap,
                                 dtype, part, ws, cap, l2);
                continue;
            }
#endif
#if CB_HAVE_AVX2
            if (avx2) {
                decode_task_avx2_any(q, q_stride, kc, vc, table, j0, j1, b, h0, h0 + per, H, Hkv, D, bs, scale, softcap,
                                     dtype, part, ws, cap, l2);
                continue;
            }
#endif
            decode_task(q, q_stride, kc, vc, table, j0, j1, b, h0, h0 + per, H, Hkv, D, Dv, bs, scale, softcap,
                        dtype, part, ws, cap);
        }
        free(ws);
    }
    if (!failed) {
#pragma omp parallel for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t b = u / split, h0 = (u % split) * per;
            merge_parts(parts + u * chunks * stride, chunks, R, Dv, stride, dtype, out, (b * H + h0 * G) * Dv);
        }
    }
    free(parts);
    return failed ? 3 : 0;
}

/* Copies each token's keys ([Hkv * D] contiguous elements) and values ([Hkv * Dv]; rows `*_stride`
 * elements apart) into its slot (-1: nowhere).  Returns 2, writing nothing, if a slot lies outside
 * the cache's num_slots. */
int cbgen_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                   void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems, int64_t v_row_elems,
                   int elem_size, int64_t num_slots) {
    for (int64_t t = 0; t < T; ++t)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return 2;
    const size_t k_bytes = (size_t)row_elems * elem_size, v_bytes = (size_t)v_row_elems * elem_size;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * k_bytes, (const char *)key + t * key_stride * elem_size, k_bytes);
        memcpy((char *)v_cache + slot * v_bytes, (const char *)value + t * value_stride * elem_size, v_bytes);
    }
    return 0;
}
