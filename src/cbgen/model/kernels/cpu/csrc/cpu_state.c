/* The state mixers' decode steps, run on cbgen's state slots in place: the gated delta rule's
 * recurrent form (one token at a time) and a causal convolution's update (at the end).
 *
 * transformers' torch version (torch_recurrent_gated_delta_rule, the form every Gated DeltaNet
 * mixer decodes with) makes about eight passes over each head's float32 [dk, dv] state a token, in
 * separate torch ops, on a gathered copy of the batch's states that is scattered back afterwards.
 * Here each head's state is read from its slot and written back in two passes, with nothing
 * gathered: per token, with S the head's state, g its decay and b its beta,
 *
 *   S = S * exp(g);  m = sum_i S[i, :] * k[i];  d = (v - m) * b;
 *   S = S + k (x) d;  o = sum_i S[i, :] * q[i]
 *
 * Bit for bit what the torch version computes from the same q, k (l2-normalised, q scaled), v, exp(g)
 * and b: every product is rounded before it is added (ISO C mode: GCC fuses no a * b + c), and the
 * two sums over the key dimension add in the order torch's float32 sum over a non-contiguous
 * dimension does (ColumnSum below).  That order depends on the value lane: torch sums blocks of
 * lanes as a "cascade" (runs of 2^p rows summed from zero, p = max(4, ceil(log2 dk) / 4), each run
 * added into the next level, carried upwards when a level fills) and the lanes past the last block
 * as four interleaved chains (rows 4g + c into chain c, each chain a cascade over its groups, the
 * rows past the last group into chain 0, then chain 0 + 1 + 2 + 3).  The caller passes where the
 * blocks end (``split``).  The lanes are independent, so vectorising over them and threading over
 * heads change no bit.
 *
 * Layouts (float32, contiguous): q, k [B, Hk, T, dk]; v, out [B, H, T, dv]; decay (already
 * exponentiated) and beta [B, H, T]; states [num_slots, H, dk, dv]; slots [B] int64, distinct.
 * Value head h reads query/key head h / (H / Hk); lanes [split, dv) are fewer than 32.  Sizes and slots are checked before any memory is
 * touched: rc 1 = bad sizes, rc 2 = a slot out of range or repeated. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { LEVELS = 4, CHAINS = 4, MAX_DV = 4096, MAX_DK = 1 << 16 };

static int64_t level_power(int64_t size) {
    int64_t log2 = 0;
    while (((int64_t)1 << log2) < size) ++log2;
    const int64_t p = log2 / LEVELS;
    return p > 4 ? p : 4;
}

/* One head's sum over the dk rows of [dk, dv] products, fed a row at a time, in torch's order. */
typedef struct {
    int64_t dk, dv, split;
    int64_t power, step; /* cascade lanes [0, split) */
    int64_t groups, gpower, gstep; /* chain lanes [split, dv): dk / 4 groups of 4 rows */
    float *acc; /* [LEVELS][split] */
    float *chains; /* [LEVELS][CHAINS][dv - split] */
} ColumnSum;

/* After a full run: each level's sum moves up one level while the count fills the level above. */
static inline void carry(float *acc, int64_t width, int64_t count, int64_t power) {
    const int64_t mask = ((int64_t)1 << power) - 1;
    for (int64_t level = 1; level < LEVELS; ++level) {
        float *up = acc + level * width, *low = acc + (level - 1) * width;
        for (int64_t j = 0; j < width; ++j) {
            up[j] += low[j];
            low[j] = 0.0f;
        }
        if (count & (mask << (level * power))) break;
    }
}

static void sum_begin(ColumnSum *s) {
    memset(s->acc, 0, sizeof(float) * LEVELS * s->split);
    memset(s->chains, 0, sizeof(float) * LEVELS * CHAINS * (s->dv - s->split));
}

/* Adds row i (its dv products). */
static inline void sum_row(ColumnSum *s, const float *restrict row, int64_t i) {
    float *restrict a = s->acc;
#pragma omp simd
    for (int64_t j = 0; j < s->split; ++j) a[j] += row[j];
    if ((i + 1) % s->step == 0) carry(a, s->split, i + 1, s->power);

    const int64_t n = s->dv - s->split;
    if (!n) return;
    const float *restrict tail = row + s->split;
    if (i < CHAINS * s->groups) {
        float *restrict c = s->chains + (i % CHAINS) * n;
        for (int64_t j = 0; j < n; ++j) c[j] += tail[j];
        if (i % CHAINS == CHAINS - 1) {
            const int64_t done = i / CHAINS + 1;
            if (done % s->gstep == 0) carry(s->chains, CHAINS * n, done, s->gpower);
            if (done == s->groups) /* the chains' cascades end: fold their levels */
                for (int64_t level = 1; level < LEVELS; ++level)
                    for (int64_t j = 0; j < CHAINS * n; ++j) s->chains[j] += s->chains[level * CHAINS * n + j];
        }
    } else {
        for (int64_t j = 0; j < n; ++j) s->chains[j] += tail[j];
    }
}

/* The sums, as torch stores them (added into zeros). */
static void sum_end(ColumnSum *s, float *out) {
    float *a = s->acc;
    for (int64_t level = 1; level < LEVELS; ++level)
        for (int64_t j = 0; j < s->split; ++j) a[j] += a[level * s->split + j];
    for (int64_t j = 0; j < s->split; ++j) out[j] = 0.0f + a[j];
    const int64_t n = s->dv - s->split;
    for (int64_t j = 0; j < n; ++j) {
        float p = s->chains[j];
        for (int64_t c = 1; c < CHAINS; ++c) p += s->chains[c * n + j];
        out[s->split + j] = 0.0f + p;
    }
}

static void gdn_head_token(float *restrict S, const float *restrict q, const float *restrict k,
                           const float *restrict v, float decay, float beta, float *restrict out, ColumnSum *sum,
                           float *restrict prod, float *restrict delta) {
    const int64_t dk = sum->dk, dv = sum->dv;
    sum_begin(sum);
    for (int64_t i = 0; i < dk; ++i) {
        float *restrict row = S + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
            const float s = row[j] * decay;
            row[j] = s;
            prod[j] = s * ki;
        }
        sum_row(sum, prod, i);
    }
    sum_end(sum, delta);
    for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - delta[j]) * beta;

    sum_begin(sum);
    for (int64_t i = 0; i < dk; ++i) {
        float *restrict row = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
            const float s = row[j] + ki * delta[j];
            row[j] = s;
            prod[j] = s * qi;
        }
        sum_row(sum, prod, i);
    }
    sum_end(sum, out);
}

int cbgen_gdn_recurrent(const float *q, const float *k, const float *v, const float *decay, const float *beta,
                        float *states, int64_t num_slots, const int64_t *slots, float *out, int64_t B, int64_t H,
                        int64_t Hk, int64_t T, int64_t dk, int64_t dv, int64_t split) {
    if (!q || !k || !v || !decay || !beta || !states || !slots || !out) return 1;
    if (B <= 0 || H <= 0 || Hk <= 0 || H % Hk || T <= 0 || dk <= 0 || dk > MAX_DK || dv <= 0 || dv > MAX_DV ||
        split < 0 || split > dv || dv - split >= 32 || num_slots <= 0)
        return 1;
    for (int64_t b = 0; b < B; ++b) {
        if (slots[b] < 0 || slots[b] >= num_slots) return 2;
        for (int64_t c = 0; c < b; ++c)
            if (slots[c] == slots[b]) return 2; /* two rows updating one state would race */
    }
    const int64_t group = H / Hk, tasks = B * H;
#pragma omp parallel if (tasks > 1)
    {
        float acc[LEVELS * MAX_DV], chains[LEVELS * CHAINS * 32], prod[MAX_DV], delta[MAX_DV];
        ColumnSum sum = {dk, dv, split, level_power(dk), (int64_t)1 << level_power(dk), dk / CHAINS,
                         level_power(dk / CHAINS), (int64_t)1 << level_power(dk / CHAINS), acc, chains};
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t b = task / H, h = task % H, hk = h / group;
            float *S = states + (slots[b] * H + h) * dk * dv;
            for (int64_t t = 0; t < T; ++t) {
                const int64_t vt = (b * H + h) * T + t, kt = (b * Hk + hk) * T + t;
                gdn_head_token(S, q + kt * dk, k + kt * dk, v + vt * dv, decay[vt], beta[vt], out + vt * dv, &sum,
                               prod, delta);
            }
        }
    }
    return 0;
}

/* A causal depthwise convolution's decode step (transformers' causal_conv1d_update for one token),
 * on state slots in place: each slot keeps a channel's last `width` inputs (width >= K - 1);
 * out[b, c] = sum over the K taps of the window (the last K - 1 kept inputs, then x[b, c]) times
 * weight[c, :] (plus bias[c]), and the kept inputs move one column.  Bit for bit what torch's conv1d
 * (oneDNN's depthwise kernel) computes: the taps accumulate in order from the bias (or zero), each
 * by a fused multiply-add.  The activation is left to the caller.
 *
 * float32: x [B, C] rows of stride x_stride; states [num_slots, C, width]; weight [C, K]; bias [C] or
 * NULL; out [B, C] contiguous; slots [B] int64, distinct.  rc 1 = bad sizes, rc 2 = a slot out of range or repeated. */
int cbgen_conv_update(const float *x, int64_t x_stride, float *states, int64_t num_slots, const int64_t *slots,
                      int64_t width, const float *weight, const float *bias, float *out, int64_t B, int64_t C,
                      int64_t K) {
    if (!x || !states || !slots || !weight || !out) return 1;
    if (B <= 0 || C <= 0 || K < 2 || K > 64 || width < K - 1 || width > 64 || x_stride < C || num_slots <= 0)
        return 1;
    for (int64_t b = 0; b < B; ++b) {
        if (slots[b] < 0 || slots[b] >= num_slots) return 2;
        for (int64_t c = 0; c < b; ++c)
            if (slots[c] == slots[b]) return 2;
    }
    const int64_t skip = width - (K - 1);
#pragma omp parallel for schedule(static) if (B * C * K >= (1 << 16))
    for (int64_t b = 0; b < B; ++b) {
        float *kept = states + slots[b] * C * width;
        const float *xb = x + b * x_stride;
        float *ob = out + b * C;
        for (int64_t c = 0; c < C; ++c) {
            float *w = kept + c * width;
            const float *wc = weight + c * K;
            float acc = bias ? bias[c] : 0.0f;
            for (int64_t k = 0; k < K - 1; ++k) acc = fmaf(w[skip + k], wc[k], acc);
            acc = fmaf(xb[c], wc[K - 1], acc);
            ob[c] = acc;
            for (int64_t k = 0; k + 1 < width; ++k) w[k] = w[k + 1];
            w[width - 1] = xb[c];
        }
    }
    return 0;
}
