"""Times parity mode's paged attention against the default decode kernel (its AVX2 loops, the
measured choice on a Zen 4) on decode rows.

SmolLM2's heads (9 query, 3 kv, head_dim 64), bfloat16, block size 16.  Each case holds 30 layers'
worth of cache in shuffled blocks and calls one layer after another, so every call reads its keys
and values cold, as a real decode step does.  Prints the median over 5 passes of the 30 calls.

    python benchmarks/parity_attention_bench.py
"""

from __future__ import annotations

import statistics
import time

import torch

from cbgen.batch_invariant.kernels.cpu_parity import parity_attention
from cbgen.model.kernels.cpu import ops
from cbgen.utils import advise_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CASES = [(64, 200), (128, 230), (64, 1000)]  # (rows, keys): chat, grpo, a long context


def _median_ms(call, tables) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for table in tables:
            call(table)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _case(rows: int, keys: int, dtype: torch.dtype) -> tuple[float, float]:
    """Milliseconds for the default decode kernel and the parity attention over 30 cold layers."""
    width = keys // BLOCK + 1
    blocks = LAYERS * rows * width + 1
    # On transparent huge pages where the OS grants them, as the engine allocates its cache.
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = advise_huge_pages(torch.empty(shape, dtype=dtype)).copy_(torch.randn(shape))
    v_cache = advise_huge_pages(torch.empty(shape, dtype=dtype)).copy_(torch.randn(shape))
    perm = torch.randperm(blocks - 1)
    tables = [
        perm[i * rows * width : (i + 1) * rows * width].view(rows, width).to(torch.int32).contiguous()
        for i in range(LAYERS)
    ]
    lens = torch.full((rows,), keys, dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    zeros, order, pos = torch.zeros(rows, dtype=torch.long), torch.arange(rows), lens.long() - 1

    def default(table: torch.Tensor) -> None:
        ops.decode_direct(q, k_cache, v_cache, table, lens, 0.125, 0, 0.0, impl=ops.IMPL_AVX2)

    def parity(table: torch.Tensor) -> None:
        parity_attention(q, k_cache, v_cache, table, zeros, order, pos, 0.125)

    return _median_ms(default, tables), _median_ms(parity, tables)


def main() -> None:
    if not ops.available():
        raise SystemExit("the C kernels did not build here")
    torch.manual_seed(0)
    for rows, keys in CASES:
        default, parity = _case(rows, keys, torch.bfloat16)
        print(
            f"{rows} rows x {keys} keys, {LAYERS} layers: default {default:.1f} ms, parity {parity:.1f} ms "
            f"({parity / default:.2f}x)"
        )


if __name__ == "__main__":
    main()
