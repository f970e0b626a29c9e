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
 * Layouts (all contiguous):
 *   q, out         [B, H, D]
 *   k/v cache      [num_blocks, block_size, Hkv, D]
 *   block_table    [B, table_stride] int32
 *   seq_lens       [B] int32, context length including the new token
 *   key/value      [T, Hkv, D]   (store), slot_mapping [T] int64, -1 = write nowhere
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

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
static void decode_task(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n,
                        int64_t b, int h0, int h1, int H, int Hkv, int D, int bs, float scale,
                        int64_t window, float softcap, int dtype, void *out, float *ws, int64_t cap) {
    const int G = H / Hkv, nh = h1 - h0, R = nh * G; /* R query heads in this task */
    const int64_t tok_stride = (int64_t)Hkv * D;
    const int64_t start = (window > 0 && n > window) ? n - window : 0;
    float *qf = ws, *acc = qf + (size_t)R * D, *rowbuf = acc + (size_t)R * D, *scores = rowbuf + (size_t)nh * D;
    const float *qsrc = as_f32(q, (b * H + (int64_t)h0 * G) * D, R * D, dtype, qf);
    for (int i = 0; i < R * D; ++i) qf[i] = qsrc[i] * scale;

    for (int pass = 0; pass < 2; ++pass) {
        const void *cache = pass == 0 ? kc : vc;
        if (pass == 1) memset(acc, 0, sizeof(float) * (size_t)R * D);
        for (int64_t j = start; j < n;) {
            const int64_t off = j % bs, cnt = (bs - off) < (n - j) ? (bs - off) : (n - j);
            const int64_t first = ((int64_t)table[j / bs] * bs + off) * tok_stride + (int64_t)h0 * D;
            for (int64_t t = 0; t < cnt; ++t, ++j) {
                const float *row = as_f32(cache, first + t * tok_stride, nh * D, dtype, rowbuf);
                for (int r = 0; r < R; ++r) {
                    const float *x = row + (r / G) * D;
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
                for (int64_t i = 0; i < L; ++i) m = sr[i] > m ? sr[i] : m;
                for (int64_t i = 0; i < L; ++i) {
                    sr[i] = expf(sr[i] - m);
                    sum += sr[i];
                }
                const float inv = 1.f / sum;
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

int cbgen_paged_decode(const void *q, const void *kc, const void *vc, const int32_t *block_table,
                       int64_t table_stride, const int32_t *seq_lens, void *out, int64_t B, int H,
                       int Hkv, int D, int bs, float scale, int64_t window, float softcap, int dtype) {
    if (H % Hkv != 0 || dtype < 0 || dtype > 1) return 1;
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
            decode_task(q, kc, vc, block_table + b * table_stride, seq_lens[b], b, h0, h0 + per, H, Hkv, D,
                        bs, scale, window, softcap, dtype, out, ws, cap);
        }
        free(ws);
    }
    return failed ? 3 : 0;
}

/* Copies each token's keys and values ([Hkv * D] contiguous elements) into its slot. */
int cbgen_store_kv(const void *key, const void *value, void *k_cache, void *v_cache,
                   const int64_t *slot_mapping, int64_t T, int64_t row_elems, int elem_size) {
    const size_t row_bytes = (size_t)row_elems * elem_size;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row_bytes, (const char *)key + t * row_bytes, row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)value + t * row_bytes, row_bytes);
    }
    return 0;
}
