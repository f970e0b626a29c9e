/* The paged-KV entry points of cpu_paged.c that other C files call (cpu_decoder.c's decode step):
 * one declaration, so the compiler checks every caller against the definition. */
#ifndef CBGEN_PAGED_H
#define CBGEN_PAGED_H

#include <stdint.h>

int cbgen_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                   void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems, int64_t v_row_elems,
                   int elem_size, int64_t num_slots);
int cbgen_paged_decode(const void *q, int64_t q_stride, const void *kc, const void *vc, const int32_t *block_table,
                       int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int64_t B,
                       int H, int Hkv, int D, int Dv, int bs, int64_t num_blocks, float scale, int64_t window,
                       float softcap, int dtype, int impl);

#endif
