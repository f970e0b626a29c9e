"""Random paged-KV cases shared by the kernel tests (triton and C) and their torch reference."""

from __future__ import annotations

import torch

NUM_BLOCKS = 48
# A block-table value that would fault (or read far out of bounds) if a kernel ever dereferenced it.
GARBAGE_BLOCK = 1 << 30


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    else:
        assert rel_err(actual, expected) < 1e-2


def make_case(
    seed: int,
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_blocks: int = 2,
) -> tuple[torch.Tensor, ...]:
    """Random query/caches plus a block table whose unused tail is poisoned with ``GARBAGE_BLOCK``.

    Returns ``(query, k_cache, v_cache, block_table, clean_table, seq_lens)``; ``clean_table`` has
    the poisoned entries replaced by 0 so the gather-based reference can consume it.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(NUM_BLOCKS, max(-(-n // block_size) for n in lens))
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    max_blocks = max(-(-n // block_size) for n in lens) + extra_blocks
    table = torch.full((len(lens), max_blocks), GARBAGE_BLOCK, dtype=torch.int32)
    for row, n in enumerate(lens):
        used = -(-n // block_size)
        table[row, :used] = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    clean = table.masked_fill(table == GARBAGE_BLOCK, 0)
    return query, k_cache, v_cache, table, clean, torch.tensor(lens, dtype=torch.int32)


# 70 crosses the 64-token tile used for head_dim <= 64, so the online-softmax rescale is exercised;
# 0 is a padding row.
LENS = [1, 7, 16, 0, 17, 40, 70]
