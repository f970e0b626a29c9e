"""Random paged-KV cases shared by the kernel and backend tests (triton, C, flash-attn fakes) and
their torch reference."""

from __future__ import annotations

import numpy as np
import torch

from cbgen import SamplingParams
from cbgen.model.input_batch import InputBuilder, ModelInput
from cbgen.model.kernels.reference import paged_ops, varlen
from cbgen.request import Request

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
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random query/caches plus a block table whose unused tail is poisoned with ``GARBAGE_BLOCK``
    (``v_head_dim``: values of another head size than keys, as latent attention's).

    Returns ``(query, k_cache, v_cache, block_table, clean_table, seq_lens)``; ``clean_table`` has
    the poisoned entries replaced by 0 so the gather-based reference can consume it.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(NUM_BLOCKS, max(-(-n // block_size) for n in lens))
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_dim = v_head_dim or head_dim
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, v_dim, generator=gen).to(dtype)
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
    v_head_dim: int | None = None,
    **kernel_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Runs a paged-decode ``kernel`` (``paged_ops.paged_decode_attention``'s signature) on a random
    case with a poisoned block-table tail and compares it with the float32 torch reference; padding
    rows must come out as exact zeros.  Returns ``(k_cache, block_table, seq_lens, scale)`` as passed
    to the kernel, for further checks."""
    query, k_cache, v_cache, table, clean, seq_lens = make_case(
        seed, lens, num_heads, num_kv_heads, head_dim, block_size, dtype, v_head_dim=v_head_dim
    )
    scale = head_dim**-0.5
    out = kernel(query, k_cache, v_cache, table, seq_lens, scale, sliding_window, softcap, **kernel_kwargs)
    expected = paged_ops.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), clean, seq_lens, scale, sliding_window, softcap
    )
    assert out.shape == (*query.shape[:2], v_cache.shape[-1]) and out.dtype == dtype
    live = seq_lens > 0
    assert_close(out[live].float(), expected[live], dtype)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    return k_cache, table, seq_lens, scale


# Prefill chunks as (query tokens, context tokens): without context and after it, lengths on and off
# the 8-token block and across the 16-token tiles of the Triton kernel.
CHUNKS = [(5, 0), (17, 9), (12, 40), (16, 0), (2, 3)]


def make_varlen_case(
    seed: int,
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_blocks: int = 2,
) -> tuple[torch.Tensor, ...]:
    """A varlen prefill case: packed ``query [Tq, H, D]``, random caches (the chunks' own K/V taken
    as already stored), a block table with a poisoned tail (``GARBAGE_BLOCK``), its clean copy for
    the reference, ``cu_seqlens_q`` and ``seq_lens_k`` (int32).

    Returns ``(query, k_cache, v_cache, block_table, clean_table, cu_seqlens_q, seq_lens_k)``."""
    k_lens = [q + c for q, c in chunks]
    _, k_cache, v_cache, table, clean, seq_lens = make_case(
        seed, k_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_blocks
    )
    gen = torch.Generator().manual_seed(seed + 1)
    total = sum(q for q, _ in chunks)
    query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([q for q, _ in chunks]).cumsum(0)
    return query, k_cache, v_cache, table, clean, cu, seq_lens


def naive_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    clean_table: torch.Tensor,
    chunks: list[tuple[int, int]],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The varlen contract written out query by query in float64: query ``j`` of a chunk after ``c``
    context tokens sees keys ``p <= c + j`` (and ``p > c + j - window``)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for i, (q_len, ctx) in enumerate(chunks):
        blocks = clean_table[i].long()
        for j in range(q_len):
            pos = ctx + j
            keys = torch.arange(pos + 1)
            if sliding_window is not None:
                keys = keys[keys > pos - sliding_window]
            slots = blocks[keys // block_size] * block_size + keys % block_size
            k = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots].double()
            v = v_cache.reshape(-1, kv_heads, v_cache.shape[-1])[slots].double()
            for h in range(query.shape[1]):
                scores = k[:, h // group] @ query[row, h].double() * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[row, h] = torch.softmax(scores, 0) @ v[:, h // group]
            row += 1
    return out


# Whole steps built by the engine's input builder, for the backends' prefill tests.
STEP_BLOCKS = 96
# (query tokens, context tokens): short and long chunks, with and without context, on and off blocks.
STEP_CHUNKS = [(5, 0), (70, 9), (12, 40), (100, 0), (2, 3), (33, 0)]


def build_step(
    chunks: list[tuple[int, int]],
    decodes: list[int],
    block_size: int = 8,
    row_prefill_max: int = 0,
    seed: int = 0,
) -> ModelInput:
    """The builder's input for a step of decode rows (their context lengths) and prefill chunks,
    every sequence on distinct random blocks."""
    perm = iter(np.random.default_rng(seed).permutation(STEP_BLOCKS).tolist())
    scheduled = []
    for name, n, ctx in [(f"d{i}", 1, c) for i, c in enumerate(decodes)] + [
        (f"p{i}", q, c) for i, (q, c) in enumerate(chunks)
    ]:
        r = Request(name, list(range(1, ctx + n + 1)), SamplingParams(max_tokens=4))
        r.num_computed_tokens = ctx
        r.block_ids = [next(perm) for _ in range(-(-(ctx + n) // block_size))]
        scheduled.append((r, n))
    builder = InputBuilder(
        block_size, torch.device("cpu"), row_prefill_max=row_prefill_max, num_blocks=STEP_BLOCKS
    )
    return builder.build(scheduled, kv_caches=[])


def step_caches(seed: int, dtype: torch.dtype, kv_heads: int = 2, dim: int = 16, block_size: int = 8):
    gen = torch.Generator().manual_seed(seed)
    shape = (STEP_BLOCKS, block_size, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    # NaN where nothing is live yet: no strategy may read past a chunk's keys or into table padding.
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    return k_cache, v_cache


def step_reference(batch: ModelInput, q, k_cache, v_cache, window, softcap) -> torch.Tensor:
    meta, info = batch.meta, batch.meta.varlen
    nd = meta.num_decode
    args = (k_cache.float(), v_cache.float())
    prefill = varlen.varlen_prefill_attention(
        q[nd:].float(), *args, info.block_table, info.cu_seqlens_q, info.seq_lens_k, 0.25, window, softcap
    )
    if not nd:
        return prefill
    decode = paged_ops.paged_decode_attention(
        q[:nd].float(), *args, meta.decode_block_table, meta.decode_seq_lens, 0.25, window, softcap
    )
    return torch.cat([decode, prefill])
