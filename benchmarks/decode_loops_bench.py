"""The C decode-attention kernel's loop sets side by side: AVX-512 and AVX2 (where the build has
them) and the portable C loops, over 30 layers of SmolLM2's attention geometry (9 query heads, 3 KV
heads, head size 64, blocks of 16 in a shuffled order), best of 5, for a few (rows, context) shapes in
float32 and bfloat16.  The engine makes this choice itself at start (cbgen.model.cpu_fast.decode_loops);
this script shows the whole table behind it.

``--hot`` adds, per shape, the same 30 calls over the first layer's caches only (hot in L2/L3 where
they fit: what the loops cost with memory out of the way) and a torch read of every layer's K and V
(what memory gives a plain reduction right now): whether the loops are bound by memory or by their
own instructions on this machine.

Usage: ``python benchmarks/decode_loops_bench.py [--portable] [--hot]``
"""

from __future__ import annotations

import argparse
import time

import torch

from cbgen.model.cpu_fast.decode_loops import IMPLS, built_loops
from cbgen.model.kernels.cpu import ops
from cbgen.utils import advise_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((1, 2048), (1, 8192), (64, 200), (16, 1000))


def time_case(
    rows: int, ctx: int, dtype: torch.dtype, loops: list[str], hot: bool = False
) -> dict[str, float]:
    """Best-of-5 seconds of one pass over the layers, per loop set (interleaved); with ``hot``, also
    ``hot <loops>`` (30 calls over the first layer's caches) and ``read`` (torch sums of every K, V)."""
    blocks = -(-ctx // BLOCK)
    shape = (rows * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    # On transparent huge pages where the OS grants them, as the engine allocates its KV cache.
    caches = [
        tuple(advise_huge_pages(torch.empty(shape, dtype=dtype)).copy_(torch.randn(shape)) for _ in "kv")
        for _ in range(LAYERS)
    ]
    table = torch.randperm(rows * blocks).to(torch.int32).view(rows, blocks)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    names = loops + ([f"hot {n}" for n in loops] + ["read"] if hot else [])
    best = dict.fromkeys(names, float("inf"))
    for _ in range(5):
        for name in names:
            start = time.perf_counter()
            if name == "read":
                for k, v in caches:
                    k.sum(), v.sum()
            else:
                impl = IMPLS[name.removeprefix("hot ")]
                for k, v in [caches[0]] * LAYERS if name.startswith("hot ") else caches:
                    ops.decode_direct(q, k, v, table, lens, 0.125, 0, 0.0, impl)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    """Prints one markdown row per (dtype, shape): ms per loop set and GB/s of KV read."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--portable", action="store_true", help="also time the portable C loops")
    parser.add_argument("--hot", action="store_true", help="also time hot caches and a torch read")
    args = parser.parse_args()
    loops = [n for n in built_loops() if n != "portable" or args.portable]
    columns = loops + ([f"hot {n}" for n in loops] + ["read"] if args.hot else [])
    print(f"loops built here: {', '.join(built_loops())}; {torch.get_num_threads()} threads")
    print("| dtype | rows x context | " + " | ".join(f"{n} ms (GB/s)" for n in columns) + " |")
    print("|---|---|" + "---:|" * len(columns))
    for dtype in (torch.float32, torch.bfloat16):
        for rows, ctx in SHAPES:
            best = time_case(rows, ctx, dtype, loops, args.hot)
            kv = 2 * LAYERS * rows * ctx * KV_HEADS * HEAD_DIM * (4 if dtype == torch.float32 else 2)
            cells = " | ".join(f"{best[n] * 1e3:.2f} ({kv / best[n] / 1e9:.1f})" for n in columns)
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} x {ctx} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
