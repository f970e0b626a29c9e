"""Argument checks for the native kernels (C through ctypes, Triton, flash-attn).

A native kernel trusts the pointers and sizes it is given: a tensor of the wrong shape makes it read
or write past an end, silently.  Every entry point therefore checks what it receives against the
cache geometry before touching memory, and raises ``ValueError`` naming the argument.  These checks
read tensor metadata only (shapes, strides, dtypes, devices), so they cost a few microseconds per
call and never synchronise a device.  Index *values* (block ids, slots, lengths) are checked where
that is free: inside the C kernels, in a pre-pass before any KV is touched; for the CUDA kernels,
on the host when the engine builds the step (:mod:`cbgen.model.input_batch`), and by masking
inside the Triton kernels.
"""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, want: str, t: torch.Tensor) -> ValueError:
    return ValueError(f"{name}: expected {want}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def _index_ok(t: torch.Tensor, dtype: torch.dtype | None) -> bool:
    return t.dtype == dtype if dtype is not None else t.dtype in _INDEX_DTYPES


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, mixed: bool = False
) -> tuple[int, int, int, int]:
    """The ``(num_blocks, block_size, kv_heads, head_dim)`` of a paged cache pair, checked: 4-D,
    identical shapes (``mixed``: all but the value head size, for kernels that take a value head
    size of its own), dtypes and devices, contiguous."""
    if k_cache.dim() != 4 or not k_cache.is_contiguous():
        raise _fail("k_cache", "a contiguous [num_blocks, block_size, kv_heads, head_dim] tensor", k_cache)
    same = v_cache.shape[:3] == k_cache.shape[:3] if mixed else v_cache.shape == k_cache.shape
    if (
        v_cache.dim() != 4
        or not same
        or v_cache.dtype != k_cache.dtype
        or v_cache.device != k_cache.device
        or not v_cache.is_contiguous()
    ):
        raise _fail(
            "v_cache", f"a contiguous tensor like k_cache {tuple(k_cache.shape)} {k_cache.dtype}", v_cache
        )
    return tuple(k_cache.shape)


def check_store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    slot_dtype: torch.dtype | None = torch.int64,
    strided: bool = False,
    mixed: bool = False,
) -> None:
    """``key``/``value`` hold one ``[kv_heads, head_dim]`` row per slot: ``[T, kv_heads, head_dim]``
    or ``[T, kv_heads * head_dim]`` with each row contiguous (any strides with ``strided``, for
    kernels that take them); ``slots`` a 1-D ``[T]`` index tensor (``slot_dtype`` None: int32 or
    int64).  ``mixed``: values may have a head size of their own (``v_cache``'s)."""
    check_cache(k_cache, v_cache, mixed)
    if slots.dim() != 1 or not _index_ok(slots, slot_dtype) or slots.device != k_cache.device:
        raise _fail("slot_mapping", f"a 1-D {slot_dtype or 'integer'} tensor on {k_cache.device}", slots)
    tokens = slots.shape[0]
    for name, t, cache in (("key", key, k_cache), ("value", value, v_cache)):
        kv_heads, head_dim = cache.shape[2:]
        row = kv_heads * head_dim
        # Strides only matter when there is a row to copy (an empty slice keeps its parent's).
        flat_ok = t.dim() == 2 and t.shape == (tokens, row) and (t.stride(1) == 1 or row == 1 or not tokens)
        heads_ok = t.dim() == 3 and t.shape == (tokens, kv_heads, head_dim)
        dense = t.dim() == 3 and t.stride(2) == 1 and (t.stride(1) == head_dim or kv_heads == 1)
        heads_ok = heads_ok and (strided or not tokens or dense)
        if not (flat_ok or heads_ok) or t.device != k_cache.device:
            raise _fail(
                name, f"[{tokens}, {kv_heads}, {head_dim}] rows (one per slot) on {k_cache.device}", t
            )


def check_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    index_dtype: torch.dtype | None = torch.int32,
    mixed: bool = False,
) -> None:
    """``query [B, H, D]`` (heads contiguous) against a cache of ``D``-wide key heads, ``H`` a multiple
    of its kv heads; ``block_table [B, W]`` with unit inner stride and ``seq_lens [B]``, both
    ``index_dtype`` (None: int32 or int64) on the cache's device.  ``mixed``: value heads may have a
    size of their own."""
    _, _, kv_heads, head_dim = check_cache(k_cache, v_cache, mixed)
    if (
        query.dim() != 3
        or query.shape[2] != head_dim
        or query.shape[1] % kv_heads
        or query.stride(2) != 1
        or query.device != k_cache.device
    ):
        raise _fail("query", f"[B, H, {head_dim}] with H a multiple of {kv_heads} on {k_cache.device}", query)
    rows = query.shape[0]
    if (
        block_table.dim() != 2
        or block_table.shape[0] != rows
        or not _index_ok(block_table, index_dtype)
        or (block_table.stride(1) != 1 and block_table.shape[1] > 1)
        or block_table.device != k_cache.device
    ):
        raise _fail(
            "block_table", f"[{rows}, W] {index_dtype or 'integer'} with unit inner stride", block_table
        )
    if seq_lens.shape != (rows,) or not _index_ok(seq_lens, index_dtype) or seq_lens.device != k_cache.device:
        raise _fail("seq_lens", f"[{rows}] {index_dtype or 'integer'}", seq_lens)


def check_rows(name: str, t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> None:
    """A CPU ``[rows, cols]`` tensor of ``dtype`` whose rows are contiguous (any row stride)."""
    if (
        t.shape != (rows, cols)
        or t.dtype != dtype
        or t.device.type != "cpu"
        or (t.stride(1) != 1 and cols > 1)
    ):
        raise _fail(name, f"a CPU [{rows}, {cols}] {dtype} tensor with contiguous rows", t)
