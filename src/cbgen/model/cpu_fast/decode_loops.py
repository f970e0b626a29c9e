"""Which loops the C decode-attention kernel runs, measured on this machine at engine start.

The kernel has AVX-512 loops (16 lanes; scores of bf16 queries and keys through vdpbf16ps where the
CPU has AVX512-BF16) and AVX2 loops (8 lanes).  Both take the query heads of a GQA group together
for the values, and spread the next block's software prefetch over the current block's work.  Each
set comes in two forms, prefetching non-temporally into L1 (``avx512``, ``avx2``) or into L2
(``avx512-l2``, ``avx2-l2``).  Neither the wider vector nor one prefetch is the faster everywhere:

- on an AMD EPYC Zen 4 (family 25 model 17, AVX-512 + AVX512-BF16, no AMX), which runs each AVX-512
  instruction as two 256-bit halves, the AVX2 loops took 17-30% less time than the AVX-512 ones of
  that time (one query head at a time, one prefetch burst per block); the AVX-512 loops as they are
  now, prefetching into L2, took 20-35% less than either set prefetching non-temporally;
- on an AMD EPYC Zen 2 (AVX2 only), non-temporal prefetches were 3-10% faster than ones into every
  cache level.

So the engine times every form the build has on the model's attention geometry, with caches larger
than the last-level cache on huge pages as the KV cache is, and caches the answer on disk next to
the GEMM choice, keyed the same way (CPU model and flags, threads, torch, dtype and geometry).
docs/design.md has the tables.

``CBGEN_DECODE_LOOPS`` forces a choice: one of :data:`CONTENDERS`, ``portable``, or ``widest``, the
widest loops the build has with non-temporal prefetches, which is what ran before the measurement
existed and what the tests pin.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cbgen import envs
from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.utils import advise_huge_pages

log = logging.getLogger("cbgen")

# Loop names -> the kernel's ``impl`` argument.  A ``-l2`` name is the same loops with their software
# prefetches into L2 (prefetcht1) instead of non-temporal ones into L1.
IMPLS: dict[str, int] = {
    "widest": cpu_kernels.IMPL_FAST,
    "avx512": cpu_kernels.IMPL_FAST,
    "avx512-l2": cpu_kernels.IMPL_FAST | cpu_kernels.IMPL_PREFETCH_L2,
    "avx2": cpu_kernels.IMPL_AVX2,
    "avx2-l2": cpu_kernels.IMPL_AVX2 | cpu_kernels.IMPL_PREFETCH_L2,
    "portable": cpu_kernels.IMPL_PORTABLE,
}
# The vector loops the engine chooses between, where the build has them.
CONTENDERS = ("avx512", "avx512-l2", "avx2", "avx2-l2")
_MEASUREMENT_VERSION = 2
# The shapes timed: (rows, context) of a batch of chat-sized decode rows and of one long sequence.
CASES = ((64, 256), (1, 4096))
TIMING_ROUNDS = 3
# Each case cycles through enough layers' caches to exceed this many bytes, so they come from memory.
COLD_BYTES = 96 << 20
Timer = Callable[[str, int, int], float]


def built_loops() -> list[str]:
    """The loops this build of the kernels has (empty when the kernels are unavailable)."""
    if not cpu_kernels.available():
        return []
    mask = int(cpu_kernels.library().cbgen_decode_loops())
    vector = [name for bit, name in ((1, "avx512"), (2, "avx2")) if mask & bit]
    return [n for v in vector for n in (v, f"{v}-l2")] + ["portable"]


def _cache_path() -> Path:
    return gemm_choice.choice_dir() / "decode-loops.json"


def cache_key(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> str:
    """Identifies a measurement: CPU model, flags and threads, torch, dtype and attention geometry."""
    text = (
        f"v{_MEASUREMENT_VERSION}|{gemm_choice.cpu_key()}|torch={torch.__version__}|{dtype}|"
        f"{heads},{kv_heads},{head_dim},{block_size}|{CASES}"
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def time_loops(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> Timer:
    """A timer over synthetic caches of this geometry: ``timer(loops, rows, context)`` is the best
    of one pass over the case's layers, in seconds."""
    made: dict[tuple[int, int], tuple] = {}

    def setup(rows: int, ctx: int) -> tuple:
        if (rows, ctx) not in made:
            blocks = -(-ctx // block_size)
            per_layer = 2 * rows * blocks * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
            layers = max(2, min(16, -(-COLD_BYTES // per_layer)))
            shape = (rows * blocks, block_size, kv_heads, head_dim)
            # On transparent huge pages where the OS grants them, as the engine's KV cache is
            # (cbgen.model.kv_cache): on 4 KiB pages the scattered blocks add TLB misses that the
            # engine does not pay, and they favoured one set of loops over the other.
            caches = [
                (
                    advise_huge_pages(torch.empty(shape, dtype=dtype)).fill_(0.01),
                    advise_huge_pages(torch.empty(shape, dtype=dtype)).fill_(0.02),
                )
                for _ in range(layers)
            ]
            # Blocks in a shuffled order, as a cache that has served many requests hands them out.
            table = torch.randperm(rows * blocks, generator=torch.Generator().manual_seed(0))
            table = table.to(torch.int32).view(rows, blocks)
            lens = torch.full((rows,), ctx, dtype=torch.int32)
            query = torch.full((rows, heads, head_dim), 0.5, dtype=dtype)
            made[(rows, ctx)] = (caches, table, lens, query)
        return made[(rows, ctx)]

    def timer(loops: str, rows: int, ctx: int) -> float:
        caches, table, lens, query = setup(rows, ctx)
        out = torch.empty_like(query)
        start = time.perf_counter()
        for k, v in caches:
            cpu_kernels.decode_direct(query, k, v, table, lens, 0.125, 0, 0.0, IMPLS[loops], out=out)
        return time.perf_counter() - start

    return timer


def choose(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    timer: Timer | None = None,
    cache_path: Path | None = None,
    available: list[str] | None = None,
) -> tuple[str, str]:
    """``(loops, why)``: the decode loops for this attention geometry (a key of :data:`IMPLS`)."""
    available = built_loops() if available is None else available
    forced = (envs.get("CBGEN_DECODE_LOOPS") or "").strip()
    if forced:
        if forced != "widest" and forced not in available:
            raise ValueError(f"CBGEN_DECODE_LOOPS={forced!r}: this build's loops are {available}")
        return forced, "CBGEN_DECODE_LOOPS"
    # Only the widest loops serve every head size: the AVX-512 ones need D % 16, the AVX2 ones D % 8.
    contenders = [n for n in CONTENDERS if n in available]
    if len(contenders) < 2 or head_dim % 16 or head_dim > 256:
        return "widest", "the widest loops this build has for this head size (nothing to choose)"
    key = cache_key(dtype, heads, kv_heads, head_dim, block_size)
    path = cache_path or _cache_path()
    stored = gemm_choice.read_cache(path)
    entry = stored.get(key)
    if entry is not None and entry.get("loops") in contenders:
        return entry[
            "loops"
        ], f"measured on this machine before ({_ratio_text(entry['loops'], entry['score'])})"
    timer = timer or time_loops(dtype, heads, kv_heads, head_dim, block_size)
    # Candidates take turns and keep their best round, as the GEMM choice does; a case's times are
    # taken relative to its fastest, so the long case counts as much as the batched one.
    best = {(n, c): float("inf") for n in contenders for c in CASES}
    for _ in range(TIMING_ROUNDS):
        for case in CASES:
            for name in contenders:
                best[(name, case)] = min(best[(name, case)], timer(name, *case))
    score = {
        n: sum(best[(n, c)] / min(best[(m, c)] for m in contenders) for c in CASES) / len(CASES)
        for n in contenders
    }
    winner = min(score, key=score.get)
    stored[key] = {
        "loops": winner,
        "score": score,
        "cpu": gemm_choice.cpu_key().split("|")[1],
        "dtype": str(dtype),
    }
    gemm_choice.write_cache(path, stored)
    log.info("cbgen: decode attention loops measured here: %s (%s)", winner, _ratio_text(winner, score))
    return winner, f"measured on this machine ({_ratio_text(winner, score)})"


def _ratio_text(winner: str, score: dict[str, float]) -> str:
    others = ", ".join(f"{n} {t / score[winner]:.2f}x its time" for n, t in score.items() if n != winner)
    return f"{others} at chat and long-context shapes" if others else "alone"


__all__ = ["IMPLS", "built_loops", "choose", "time_loops"]
