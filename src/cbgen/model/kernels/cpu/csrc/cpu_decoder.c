/* A whole decode step of a Llama-family model in one call: every layer's projections, rotary
 * embedding, KV store, paged decode attention, residual adds and norms.
 *
 * Why: the same kernels called one by one from Python cost ~10 calls a layer, each with tens of
 * microseconds of interpreter and binding work that runs with cold caches (a step streams ~0.5 GB
 * of weights and KV through them).  That was ~15% of a 64-row bf16 decode step on SmolLM2 (Intel,
 * AMX), and more of a one-row step.  The math and rounding are exactly those of the Python loop in
 * fused_decode.py, which tests hold to.
 *
 * dtype: 0 = float32, 1 = bfloat16 (activations, norms, biases, KV cache).  gemm: which kernel runs
 * the projections and so what the weight pointers point to: 0 = AMX (bf16 only; amx_pack layouts,
 * csrc/cpu_gemm.c), 1 = the panel GEMM on float32 panels, 2 = the panel GEMM on bf16 panels
 * (cbgen_panel_pack layouts, csrc/cpu_panel.c), 3 = the vdpbf16ps GEMM (bf16 only; cbgen_dp_pack
 * layouts), 4 = the AVX-512 float32 panel GEMM (float32 only; cbgen_p512_pack layouts; both
 * csrc/cpu_panel512.c).  attn_impl: the decode attention loops
 * (cbgen_paged_decode's impl: the engine's measured choice).
 *
 * Layer records (fused_decode.py builds them): LAYER_WORDS int64 words and LAYER_FLOATS floats each,
 * indexed by the enums below.  Biases may be 0.
 *
 * The field lists below are the one definition of that layout: they make the enums, and
 * cbgen_decoder_layout() hands the same names, in order, with the record sizes, to cpu_kernels.py
 * when it loads the library.  Python fills records by field name and refuses a record whose names
 * differ from these, so a field added, removed or moved here is never read from the wrong slot.
 */
#include <omp.h>
#include <stdint.h>

#include "cbgen_paged.h"

int cbgen_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                     int64_t os, int64_t M, int64_t N, int64_t K);
int cbgen_panel_gemm(const void *x, int64_t x_stride, const void *packed, int64_t packed_size, const void *bias,
                     void *out, int64_t out_stride, int64_t M, int64_t N, int64_t K, int dtype, int pdtype);
int cbgen_dp_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t packed_size,
                  const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t M, int64_t N, int64_t K);
int cbgen_p512_gemm(const float *x, int64_t x_stride, const float *packed, int64_t packed_size, const float *bias,
                    float *out, int64_t out_stride, int64_t M, int64_t N, int64_t K);
int cbgen_add_rmsnorm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t n,
                      int64_t x_stride, int64_t delta_stride, int64_t out_stride, float eps, int dtype);
int cbgen_rope(void *q, void *k, const void *cos, const void *sin, int64_t T, int H, int Hk, int D,
               int64_t q_stride, int64_t k_stride, int dtype);
int cbgen_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t n, int64_t gate_stride,
                   int64_t up_stride, int64_t out_stride, int dtype);

#define DECODER_WORDS(X)                                                                                               \
    X(W_QKV) X(B_QKV) X(W_O) X(B_O) X(W_GATE_UP) X(B_GATE_UP) X(W_DOWN) X(B_DOWN) X(POST_NORM) X(NEXT_NORM) X(K_CACHE)  \
        X(V_CACHE) X(WINDOW)
#define DECODER_FLOATS(X) X(POST_EPS) X(NEXT_EPS) X(SCALE)
#define AS_ENUM(name) name,
#define AS_NAME(name) #name " "

enum { DECODER_WORDS(AS_ENUM) WORDS_USED };
/* The step's stages, as TRY numbers them: 0 the first norm, then per layer 1 q/k/v projection, 2 rotary,
 * 3 KV store, 4 attention, 5 output projection, 6 residual + norm, 7 gate/up projection, 8 SiLU x up,
 * 9 down projection, 10 residual + norm. */
enum { DECODER_STAGES = 11 };
int cbgen_decoder_stages(void) { return DECODER_STAGES; }
enum { DECODER_FLOATS(AS_ENUM) FLOATS_USED };
/* Record sizes, with room to spare at the end (unused entries stay zero). */
enum { LAYER_WORDS = 16, LAYER_FLOATS = 4 };
_Static_assert(WORDS_USED <= LAYER_WORDS && FLOATS_USED <= LAYER_FLOATS, "layer record overflows its padding");

/* Record sizes into words/floats; returns the field names in record order, space-separated, the
 * word fields, then ';', then the float fields. */
const char *cbgen_decoder_layout(int64_t *words, int64_t *floats) {
    *words = LAYER_WORDS;
    *floats = LAYER_FLOATS;
    return DECODER_WORDS(AS_NAME) ";" DECODER_FLOATS(AS_NAME);
}

#define PTR(word) ((void *)(intptr_t)(word))
/* Runs one stage; with a stage_s buffer, adds its wall seconds to stage_s[stage] (a diagnostic: where
 * the step's time goes, benchmarks/step_budget.py). */
#define TRY(stage, call)                                                                                                \
    do {                                                                                                               \
        const double t0_ = stage_s ? omp_get_wtime() : 0.0;                                                            \
        if ((call) != 0) return 1 + (int)(l * 16 + (stage));                                                           \
        if (stage_s) stage_s[stage] += omp_get_wtime() - t0_;                                                          \
    } while (0)

/* out [M, N] (row stride os) = x [M, K] (row stride xs) W^T + bias on the step's GEMM. */
static int project(const void *x, int64_t xs, int64_t w, int64_t bias, void *out, int64_t os, int64_t M, int64_t N,
                   int64_t K, int dtype, int gemm) {
    if (gemm == 0)
        return dtype == 1 ? cbgen_amx_linear((const uint16_t *)x, xs, (const uint16_t *)PTR(w),
                                             (const uint16_t *)PTR(bias), (uint16_t *)out, os, M, N, K)
                          : 1;
    if (gemm == 3) /* cbgen_dp_pack's layout */
        return dtype == 1 ? cbgen_dp_gemm((const uint16_t *)x, xs, (const uint16_t *)PTR(w),
                                          (N + 31) / 32 * ((K + 1) / 2) * 64, (const uint16_t *)PTR(bias),
                                          (uint16_t *)out, os, M, N, K)
                          : 1;
    if (gemm == 4) /* cbgen_p512_pack's layout */
        return dtype == 0 ? cbgen_p512_gemm((const float *)x, xs, (const float *)PTR(w), (N + 31) / 32 * K * 32,
                                            (const float *)PTR(bias), (float *)out, os, M, N, K)
                          : 1;
    const int64_t packed = (N + 15) / 16 * K * 16; /* cbgen_panel_pack's size for this weight */
    return cbgen_panel_gemm(x, xs, PTR(w), packed, PTR(bias), out, os, M, N, K, dtype, gemm - 1);
}

/* hidden [T, E] (the residual stream, updated in place) -> x [T, E], the final norm's output.
 * Scratch: qkv [T, (H + 2 Hkv) D], attn [T, H D], gate_up [T, 2 I], act [T, I], delta [T, E], all of
 * dtype.  stage_s: 0, or DECODER_STAGES doubles that each stage's seconds are added to (stages as
 * numbered below).  Returns 0, 1 for a bad dtype or gemm, or 1 + 16 * layer + stage of the first
 * kernel that failed. */
int cbgen_decoder_step(const int64_t *layers, const float *floats, int n_layers, const void *first_norm,
                       float first_eps, void *hidden, void *x, void *qkv, void *attn, void *gate_up, void *act,
                       void *delta, const void *cos, const void *sin, const int32_t *table, int64_t table_stride,
                       int64_t table_width, const int32_t *seq_lens, const int64_t *slots, int64_t T, int64_t E, int H,
                       int Hkv, int D, int64_t I, int block_size, int64_t num_blocks, int dtype, int gemm,
                       int attn_impl, double *stage_s) {
    if (dtype < 0 || dtype > 1 || gemm < 0 || gemm > 4) return 1;
    if (((gemm == 0 || gemm == 3) && dtype != 1) || (gemm == 4 && dtype != 0)) return 1;
    if (attn_impl < 0 || attn_impl > 7 || (attn_impl & 3) == 3) return 1;
    const int64_t qd = (int64_t)H * D, kd = (int64_t)Hkv * D, nqkv = qd + 2 * kd;
    const int esize = dtype == 0 ? 4 : 2;
    char *const q = (char *)qkv, *const k = q + qd * esize, *const v = k + kd * esize;
    char *const up = (char *)gate_up + I * esize;
    int l = 0;
    TRY(0, cbgen_add_rmsnorm(hidden, 0, first_norm, x, T, E, E, 0, E, first_eps, dtype));
    for (l = 0; l < n_layers; ++l) {
        const int64_t *w = layers + (int64_t)l * LAYER_WORDS;
        const float *f = floats + (int64_t)l * LAYER_FLOATS;
        TRY(1, project(x, E, w[W_QKV], w[B_QKV], qkv, nqkv, T, nqkv, E, dtype, gemm));
        TRY(2, cbgen_rope(q, k, cos, sin, T, H, Hkv, D, nqkv, nqkv, dtype));
        TRY(3, cbgen_store_kv(k, nqkv, v, nqkv, PTR(w[K_CACHE]), PTR(w[V_CACHE]), slots, T, kd, kd, esize,
                              num_blocks * block_size));
        TRY(4, cbgen_paged_decode(q, nqkv, PTR(w[K_CACHE]), PTR(w[V_CACHE]), table, table_stride, table_width,
                                  seq_lens, attn, T, H, Hkv, D, D, block_size, num_blocks, f[SCALE], w[WINDOW], 0.0f,
                                  dtype, attn_impl));
        TRY(5, project(attn, qd, w[W_O], w[B_O], delta, E, T, E, qd, dtype, gemm));
        TRY(6, cbgen_add_rmsnorm(hidden, delta, PTR(w[POST_NORM]), x, T, E, E, E, E, f[POST_EPS], dtype));
        TRY(7, project(x, E, w[W_GATE_UP], w[B_GATE_UP], gate_up, 2 * I, T, 2 * I, E, dtype, gemm));
        TRY(8, cbgen_silu_mul(gate_up, up, act, T, I, 2 * I, 2 * I, I, dtype));
        TRY(9, project(act, I, w[W_DOWN], w[B_DOWN], delta, E, T, E, I, dtype, gemm));
        TRY(10, cbgen_add_rmsnorm(hidden, delta, PTR(w[NEXT_NORM]), x, T, E, E, E, E, f[NEXT_EPS], dtype));
    }
    return 0;
}
