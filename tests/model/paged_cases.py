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


def check_decode(
    kernel,
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kernel_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Runs a paged-decode ``kernel`` (``paged_ops.paged_decode_attention``'s signature) on a random
    case with a poisoned block-table tail and compares it with the float32 torch reference; padding
    rows must come out as exact zeros.  Returns ``(k_cache, block_table, seq_lens, scale)`` as passed
    to the kernel, for further checks."""
    from cbgen.model.kernels.reference import paged_ops

    query, k_cache, v_cache, table, clean, seq_lens = make_case(
        seed, lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = kernel(query, k_cache, v_cache, table, seq_lens, scale, sliding_window, softcap, **kernel_kwargs)
    expected = paged_ops.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), clean, seq_lens, scale, sliding_window, softcap
    )
    assert out.shape == query.shape and out.dtype == dtype
    live = seq_lens > 0
    assert_close(out[live].float(), expected[live], dtype)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    return k_cache, table, seq_lens, scale
