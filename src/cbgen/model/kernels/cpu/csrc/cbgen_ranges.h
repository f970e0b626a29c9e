/* How the GEMM drivers share a call's panels among threads: thread t owns the t-th contiguous range
 * of them and takes it front to back, then takes what is left of the other threads' ranges, in the
 * same way.  Why: handed out one at a time as threads ask (OpenMP dynamic), the two threads of a
 * 2-core AMD EPYC Zen 4 (family 25 model 17) took alternate panels, so neither read the packed
 * weights as one stream, and the shared counter's cache line went back and forth; contiguous ranges
 * ran SmolLM2's projections 8-36% faster (AVX-512 panels, bf16, 1-64 rows, cold weights).  A plain
 * static split was as fast but left a thread idle at the closing barrier when the other one woke
 * late (10% slower with OMP_WAIT_POLICY=PASSIVE at one row); taking the rest of another's range
 * keeps both busy.  Each claim is an atomic increment of the range's own counter, on its own cache
 * line.  Which thread computes a panel never changes what is computed. */
#ifndef CBGEN_RANGES_H
#define CBGEN_RANGES_H

#include <stdint.h>

enum { CB_MAX_RANGES = 64 };
typedef struct {
    _Alignas(64) int64_t next; /* a cache line to itself */
} cb_range_cursor;
_Static_assert(sizeof(cb_range_cursor) == 64, "one cursor per cache line");

/* The range count for a parallel region of max_threads threads. */
static inline int cb_ranges(int max_threads) { return max_threads < CB_MAX_RANGES ? max_threads : CB_MAX_RANGES; }

/* Before the parallel region: every range back at its start. */
static inline void cb_ranges_reset(cb_range_cursor *cursor, int ranges, int64_t items) {
    for (int u = 0; u < ranges; ++u) cursor[u].next = u * items / ranges;
}

/* One thread's walk over the ranges: its own first, then the others' (a range whose thread never
 * came, with fewer threads than asked for, is taken by the others). */
typedef struct {
    cb_range_cursor *cursor;
    int64_t items;
    int ranges, thread, visited;
} cb_claim;

/* The next item for this thread, or -1 when every range is used up. */
static inline int64_t cb_next(cb_claim *c) {
    for (; c->visited < c->ranges; ++c->visited) {
        const int u = (c->thread + c->visited) % c->ranges;
        const int64_t end = (u + 1) * c->items / c->ranges;
        const int64_t p = __atomic_fetch_add(&c->cursor[u].next, 1, __ATOMIC_RELAXED);
        if (p < end) return p;
    }
    return -1;
}

#endif
