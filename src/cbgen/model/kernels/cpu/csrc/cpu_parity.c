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
#include <stdint.h>
#include <stdlib.h>

#include "cbgen_numerics.h"

/* Keys scored together: TC independent sums keep the FMA pipes busy.  The grouping changes no
 * key's order. */
enum { LANES = 8, TC = 4 };

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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m256 widen8(const void *p, int64_t i, const int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* sums[c][lane] over the first D8 elements of q (float32) and key c (ks apart). */
static inline __attribute__((always_inline)) void dot_keys(const float *q, const void *k, int64_t ks, int64_t D8,
                                                          float *sums, const int C, const int dtype) {
    __m256 acc[TC];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += LANES) {
        const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(qv, widen8(k, c * ks + d, dtype), acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(sums + c * LANES, acc[c]);
}

/* acc[0..D) = fmaf(e, v[0..D), acc[0..D)). */
static inline void axpy(float *acc, float e, const void *v, int64_t D, const int dtype) {
    int64_t d = 0;
    const __m256 ev = _mm256_set1_ps(e);
    for (; d + LANES <= D; d += LANES)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(ev, widen8(v, d, dtype), _mm256_loadu_ps(acc + d)));
    for (; d < D; ++d) acc[d] = fmaf(e, load1(v, d, dtype), acc[d]);
}
#else
static inline void dot_keys(const float *q, const void *k, int64_t ks, int64_t D8, float *sums, const int C,
                            const int dtype) {
    for (int c = 0; c < C; ++c) {
        float *s = sums + c * LANES;
        for (int l = 0; l < LANES; ++l) s[l] = 0.0f;
        for (int64_t d = 0; d < D8; d += LANES)
            for (int l = 0; l < LANES; ++l) s[l] = fmaf(q[d + l], load1(k, c * ks + d + l, dtype), s[l]);
    }
}

static inline void axpy(float *acc, float e, const void *v, int64_t D, const int dtype) {
    for (int64_t d = 0; d < D; ++d) acc[d] = fmaf(e, load1(v, d, dtype), acc[d]);
}
#endif

/* One dot product from its 8 partial sums: the fold, then the D % 8 tail in order. */
static inline float finish(const float *s, const float *q, const void *k, int64_t D8, int64_t D, const int dtype) {
    float v = fold8(s);
    for (int64_t d = D8; d < D; ++d) v = fmaf(q[d], load1(k, d, dtype), v);
    return v;
}

/* out[c] = dot(q[0..D), key c) for C <= TC keys ks apart (q float32, keys of dtype), each in the
 * order above, as if alone. */
static void dots(const float *q, const void *k, int64_t ks, int64_t D, int C, float *out, const int dtype) {
    float s[TC * LANES];
    const int64_t D8 = D - D % LANES;
    switch (C * 2 + dtype) {
    case 2: dot_keys(q, k, ks, D8, s, 1, 0); break;
    case 3: dot_keys(q, k, ks, D8, s, 1, 1); break;
    case 4: dot_keys(q, k, ks, D8, s, 2, 0); break;
    case 5: dot_keys(q, k, ks, D8, s, 2, 1); break;
    case 6: dot_keys(q, k, ks, D8, s, 3, 0); break;
    case 7: dot_keys(q, k, ks, D8, s, 3, 1); break;
    case 8: dot_keys(q, k, ks, D8, s, 4, 0); break;
    default: dot_keys(q, k, ks, D8, s, 4, 1); break;
    }
    const int64_t esize = dtype == 0 ? 4 : 2;
    for (int c = 0; c < C; ++c) out[c] = finish(s + c * LANES, q, (const char *)k + c * ks * esize, D8, D, dtype);
}

/* Attention for T query rows of H heads (q [T, H, D], any row and head strides) over a
 * paged key/value store [num_blocks, block_size, Hkv, D] (strides kv_block, kv_slot, kv_head; D
 * contiguous).  Row t belongs to table row row_seq[t] and sits at position row_pos[t] (-1: padding,
 * output 0); the key at position j of table row g is at logical index seq_start[g] + j of that row's
 * blocks.  Causal; window > 0 keeps keys j > p - window; softcap > 0 maps a score s to
 * softcap * tanh(s / softcap).  Each query: scores in the dot order above times scale, their
 * maximum, exp(s - max), then the normaliser and the weighted values summed over its visible keys in
 * increasing position, one fused multiply-add per key and lane; out = values / normaliser. */
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
    int failed = 0;
#pragma omp parallel
    {
        float *buf = (float *)malloc((size_t)(longest + 2 * D + 1) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * H; ++task) {
            if (!buf) continue;
            const int64_t t = task / H, h = task % H, p = row_pos[t], g = row_seq[t];
            float *scores = buf, *qf = buf + longest, *acc = qf + D;
            char *o = (char *)out + (t * out_row_stride + h * D) * esize;
            if (p < 0) {
                for (int64_t d = 0; d < D; ++d) store1(o, d, 0.0f, dtype);
                continue;
            }
            const char *qp = (const char *)q + (t * q_row_stride + h * q_head_stride) * esize;
            for (int64_t d = 0; d < D; ++d) qf[d] = load1(qp, d, dtype), acc[d] = 0.0f;
            const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
            const int64_t head_off = (h / group) * kv_head;
            float top = -INFINITY;
            /* Scores a run of keys at a time (up to TC consecutive slots of one block: independent
             * sums for the FMA pipes), each key's score in the same order as a lone dot. */
            for (int64_t j = 0; j < n;) {
                const int64_t i = seq_start[g] + lo + j, slot = i % block_size;
                const int64_t run = n - j < TC ? n - j : TC, fit = block_size - slot;
                const int C = (int)(run < fit ? run : fit);
                const int64_t off = table[g * table_stride + i / block_size] * kv_block + slot * kv_slot + head_off;
                dots(qf, (const char *)k + off * esize, kv_slot, D, C, scores + j, dtype);
                for (int c = 0; c < C; ++c) {
                    float s = scores[j + c] * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    scores[j + c] = s;
                    top = s > top ? s : top;
                }
                j += C;
            }
            float norm = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                const int64_t i = seq_start[g] + lo + j;
                const int64_t off = table[g * table_stride + i / block_size] * kv_block + (i % block_size) * kv_slot;
                const float e = expf(scores[j] - top);
                norm += e;
                axpy(acc, e, (const char *)v + (off + head_off) * esize, D, dtype);
            }
            for (int64_t d = 0; d < D; ++d) store1(o, d, acc[d] / norm, dtype);
        }
        free(buf);
    }
    return failed ? 3 : 0;
}
