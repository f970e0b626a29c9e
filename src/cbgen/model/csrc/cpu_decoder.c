/* A whole bf16 decode step of a Llama-family model in one call: every layer's projections (AMX,
 * csrc/cpu_gemm.c), rotary embedding, KV store, paged decode attention, residual adds and norms.
 *
 * Why: the same kernels called one by one from Python cost ~10 calls a layer, each with tens of
 * microseconds of interpreter and binding work that runs with cold caches (a step streams ~0.5 GB
 * of weights and KV through them).  That was ~15% of a 64-row bf16 decode step on SmolLM2.  The
 * math and rounding are exactly those of the Python loop in fused_decode.py, which tests hold to.
 *
 * Layer records (fused_decode.py builds them): LAYER_WORDS int64 words and LAYER_FLOATS floats each,
 * indexed by the enums below.  Pointers to packed weights are amx_pack layouts; biases may be 0.
 *
 * The field lists below are the one definition of that layout: they make the enums, and
 * cbgen_decoder_layout() hands the same names, in order, with the record sizes, to cpu_kernels.py
 * when it loads the library.  Python fills records by field name and refuses a record whose names
 * differ from these, so a field added, removed or moved here is never read from the wrong slot.
 */
#include <stdint.h>

int cbgen_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                     int64_t os, int64_t M, int64_t N, int64_t K);
int cbgen_add_rmsnorm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t n,
                      int64_t x_stride, int64_t delta_stride, int64_t out_stride, float eps, int dtype);
int cbgen_rope(void *q, void *k, const void *cos, const void *sin, int64_t T, int H, int Hk, int D,
               int64_t q_stride, int64_t k_stride, int dtype);
int cbgen_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t n, int64_t gate_stride,
                   int64_t up_stride, int64_t out_stride, int dtype);
int cbgen_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                   void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems, int elem_size,
                   int64_t num_slots);
int cbgen_paged_decode(const void *q, int64_t q_stride, const void *kc, const void *vc, const int32_t *block_table,
                       int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int64_t B,
                       int H, int Hkv, int D, int bs, int64_t num_blocks, float scale, int64_t window, float softcap,
                       int dtype, int impl);

#define DECODER_WORDS(X)                                                                                               \
    X(W_QKV) X(B_QKV) X(W_O) X(B_O) X(W_GATE_UP) X(B_GATE_UP) X(W_DOWN) X(B_DOWN) X(POST_NORM) X(NEXT_NORM) X(K_CACHE)  \
        X(V_CACHE) X(WINDOW)
#define DECODER_FLOATS(X) X(POST_EPS) X(NEXT_EPS) X(SCALE)
#define AS_ENUM(name) name,
#define AS_NAME(name) #name " "

enum { DECODER_WORDS(AS_ENUM) WORDS_USED };
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

#define P16(word) ((uint16_t *)(intptr_t)(word))
#define TRY(stage, call)                                                                                                \
    do {                                                                                                               \
        if ((call) != 0) return 1 + (int)(l * 16 + (stage));                                                           \
    } while (0)

/* hidden [T, E] (the residual stream, updated in place) -> x [T, E], the final norm's output.
 * Scratch: qkv [T, (H + 2 Hkv) D], attn [T, H D], gate_up [T, 2 I], act [T, I], delta [T, E].
 * Returns 0, or 1 + 16 * layer + stage of the first kernel that failed. */
int cbgen_decoder_step(const int64_t *layers, const float *floats, int n_layers, const uint16_t *first_norm,
                       float first_eps, uint16_t *hidden, uint16_t *x, uint16_t *qkv, uint16_t *attn, uint16_t *gate_up,
                       uint16_t *act, uint16_t *delta, const uint16_t *cos, const uint16_t *sin, const int32_t *table,
                       int64_t table_stride, int64_t table_width, const int32_t *seq_lens, const int64_t *slots,
                       int64_t T, int64_t E, int H, int Hkv, int D, int64_t I, int block_size, int64_t num_blocks) {
    const int64_t qd = (int64_t)H * D, kd = (int64_t)Hkv * D, nqkv = qd + 2 * kd;
    int l = 0;
    TRY(0, cbgen_add_rmsnorm(hidden, 0, first_norm, x, T, E, E, 0, E, first_eps, 1));
    for (l = 0; l < n_layers; ++l) {
        const int64_t *w = layers + (int64_t)l * LAYER_WORDS;
        const float *f = floats + (int64_t)l * LAYER_FLOATS;
        TRY(1, cbgen_amx_linear(x, E, P16(w[W_QKV]), P16(w[B_QKV]), qkv, nqkv, T, nqkv, E));
        TRY(2, cbgen_rope(qkv, qkv + qd, cos, sin, T, H, Hkv, D, nqkv, nqkv, 1));
        TRY(3, cbgen_store_kv(qkv + qd, nqkv, qkv + qd + kd, nqkv, (void *)(intptr_t)w[K_CACHE],
                              (void *)(intptr_t)w[V_CACHE], slots, T, kd, 2, num_blocks * block_size));
        TRY(4, cbgen_paged_decode(qkv, nqkv, (const void *)(intptr_t)w[K_CACHE], (const void *)(intptr_t)w[V_CACHE],
                                  table, table_stride, table_width, seq_lens, attn, T, H, Hkv, D, block_size,
                                  num_blocks, f[SCALE], w[WINDOW], 0.0f, 1, 0));
        TRY(5, cbgen_amx_linear(attn, qd, P16(w[W_O]), P16(w[B_O]), delta, E, T, E, qd));
        TRY(6, cbgen_add_rmsnorm(hidden, delta, P16(w[POST_NORM]), x, T, E, E, E, E, f[POST_EPS], 1));
        TRY(7, cbgen_amx_linear(x, E, P16(w[W_GATE_UP]), P16(w[B_GATE_UP]), gate_up, 2 * I, T, 2 * I, E));
        TRY(8, cbgen_silu_mul(gate_up, gate_up + I, act, T, I, 2 * I, 2 * I, I, 1));
        TRY(9, cbgen_amx_linear(act, I, P16(w[W_DOWN]), P16(w[B_DOWN]), delta, E, T, E, I));
        TRY(10, cbgen_add_rmsnorm(hidden, delta, P16(w[NEXT_NORM]), x, T, E, E, E, E, f[NEXT_EPS], 1));
    }
    return 0;
}
