"""Triton kernels vs the torch reference, run on CPU through Triton's interpreter.

The interpreter is chosen when a kernel is jitted, so the variable is set before anything imports
triton.  Shapes stay small: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

import torch
from paged_cases import LENS, NUM_BLOCKS, check_decode, make_case

from cbgen.model import paged_ops, triton_ops


def _check_decode(*args, num_splits: int | None = None, **kwargs) -> None:
    check_decode(triton_ops.triton_paged_decode_attention, *args, num_splits=num_splits, **kwargs)


def test_available_under_interpreter() -> None:
    assert triton_ops.HAS_TRITON
    assert triton_ops.available("cpu")
    assert triton_ops.available(torch.device("cpu"))


# ------------------------------------------------------------------------------------------------
# store_kv
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_store_kv_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + num_kv_heads)
    head_dim, num_tokens = 32, 11
    # key/value as strided views into a fused projection, as a model would hand them over.
    fused = torch.randn(num_tokens, 2 * num_kv_heads, head_dim + 8, generator=gen).to(dtype)
    key, value = fused[:, :num_kv_heads, :head_dim], fused[:, num_kv_heads:, 8:]
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 10]] = -1
    caches = [
        torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
    ]
    ref_k, ref_v = (c.clone() for c in caches)
    out_k, out_v = (c.clone() for c in caches)

    paged_ops.store_kv(key, value, ref_k, ref_v, slots)
    triton_ops.triton_store_kv(key, value, out_k, out_v, slots)

    assert torch.equal(out_k, ref_k)
    assert torch.equal(out_v, ref_v)


def test_store_kv_casts_and_handles_empty() -> None:
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(5, 2, 16, generator=gen)
    value = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 17, 8, 0], dtype=torch.int32)
    ref_k, ref_v = (
        torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16),
        torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16),
    )
    out_k, out_v = ref_k.clone(), ref_v.clone()

    paged_ops.store_kv(key, value, ref_k, ref_v, slots.long())
    triton_ops.triton_store_kv(key, value, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)

    triton_ops.triton_store_kv(key[:0], value[:0], out_k, out_v, slots[:0])
    assert torch.equal(out_k, ref_k)


def test_store_kv_all_padding_writes_nothing() -> None:
    key = torch.randn(4, 2, 16)
    cache_k, cache_v = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    triton_ops.triton_store_kv(key, key, cache_k, cache_v, torch.full((4,), -1))
    assert not cache_k.any() and not cache_v.any()


# ------------------------------------------------------------------------------------------------
# decode attention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(2, 2, 16), (4, 2, 32), (8, 2, 64), (4, 1, 128)]
)
def test_decode_matches_reference(
    dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    _check_decode(LENS, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33, 100])
def test_decode_sliding_window(sliding_window: int) -> None:
    _check_decode(LENS, 4, 2, 32, 8, torch.float32, seed=sliding_window, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_decode_softcap(dtype: torch.dtype, softcap: float) -> None:
    # A cap of 0.5 drives most scores into tanh saturation; 30 is the Gemma-2-style mild cap.
    _check_decode(LENS, 4, 1, 32, 16, dtype, seed=3, softcap=softcap)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_k(num_splits: int) -> None:
    # 7 splits over short rows leaves some splits empty; the merge must ignore them.
    _check_decode(LENS, 4, 2, 16, 8, torch.float32, seed=num_splits, num_splits=num_splits)


def test_decode_split_k_with_window_softcap_bf16() -> None:
    _check_decode(LENS, 8, 2, 32, 16, torch.bfloat16, seed=11, sliding_window=20, softcap=5.0, num_splits=3)


def test_decode_fp16() -> None:
    _check_decode(LENS, 4, 2, 64, 16, torch.float16, seed=5)


def test_decode_block_size_32() -> None:
    _check_decode([1, 31, 32, 33, 65], 4, 2, 32, 32, torch.float32, seed=9)


def test_decode_strided_query_and_max_seq_len() -> None:
    lens = [5, 16, 23]
    _, k_cache, v_cache, table, clean, seq_lens = make_case(2, lens, 4, 2, 32, 8, torch.float32)
    # A query sliced out of a fused qkv projection: non-contiguous batch and head strides.
    fused = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(1))
    query = fused[:, ::2]
    out = triton_ops.triton_paged_decode_attention(
        query, k_cache, v_cache, table, seq_lens, 0.2, max_seq_len=max(lens)
    )
    expected = paged_ops.paged_decode_attention(
        query, k_cache, v_cache, clean, seq_lens, 0.2, max_seq_len=max(lens)
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_decode_all_padding_and_empty_batch() -> None:
    query, k_cache, v_cache, table, _, _ = make_case(4, [8, 8], 2, 1, 16, 8, torch.float32)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    for splits in (1, 2):
        out = triton_ops.triton_paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, 0.25, num_splits=splits
        )
        assert torch.equal(out, torch.zeros_like(out))

    empty = triton_ops.triton_paged_decode_attention(
        query[:0], k_cache, v_cache, table[:0], seq_lens[:0], 0.25
    )
    assert empty.shape == (0, 2, 16)


def test_decode_rejects_bad_gqa() -> None:
    query, k_cache, v_cache, table, _, seq_lens = make_case(0, [4], 3, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        triton_ops.triton_paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.25)
