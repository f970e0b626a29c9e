"""Triton paged varlen prefill: every prefill chunk of a step, all layers' worth of calls cut to one
per layer.

Contract and reference: :mod:`cbgen.model.kernels.reference.varlen` (flash-attn's varlen layout with
a block table).  Design notes:

* One program per (chunk, kv head, tile of ``BLOCK_M`` query tokens).  A program owns every query
  head of its GQA group: its ``BLOCK_M`` tokens x ``GROUP`` heads are the rows of one tile, so each
  K/V tile is read once per group, and the tile has enough rows for ``tl.dot`` even with one head
  per group.  Programs past their chunk's length exit at once (the grid is sized by the longest
  chunk, read on the host from the step's metadata: no sync).
* Keys come from the paged cache only, context and chunk alike (attention stores the chunk's K/V
  first), a tile of tokens at a time through the block table, with an online softmax in float32
  (base 2).  A program walks keys from its first query's window start to its last query's
  position, so causality skips the tiles after the diagonal and a window those before it.
* Masked scores are -inf; a row with no visible key yet (a window, or a padding row) keeps a zero
  weight instead of a NaN: the running maximum is replaced by 0 where it is still -inf.

As in :mod:`cbgen.model.kernels.triton.ops`, kernels are wrapped with ``triton.jit`` lazily, per
interpreter mode, and block ids outside the cache are never dereferenced.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cbgen.model.kernels.reference.varlen import check_varlen
from cbgen.model.kernels.triton.ops import (
    _MIN_DOT,
    _device_guard,
    _interpreting,
    _native_dot,
    _pow2,
    tl,
    triton,
)

__all__ = ["triton_varlen_prefill_attention"]

_LOG2E = 1.4426950408889634


def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    cu_q_ptr,
    seq_lens_k_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    softcap,
    window,
    head_dim,
    num_blocks,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_tile = tl.program_id(2)

    q_begin = tl.load(cu_q_ptr + chunk)
    q_len = tl.load(cu_q_ptr + chunk + 1) - q_begin
    first = m_tile * BLOCK_M
    if first < q_len:
        k_len = tl.load(seq_lens_k_ptr + chunk)
        ctx = k_len - q_len

        # Rows of the tile: token-major, GROUP query heads per token (padded to BLOCK_G).
        offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
        token = first + offs_r // BLOCK_G
        g = offs_r % BLOCK_G
        row_ok = (token < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        q_rows = (q_begin + token).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_mask[None, :],
            other=0.0,
        )
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        q_pos = ctx + token  # absolute position of each row's query

        # Keys [lo, hi): up to the tile's last query (causal), from its first query's window start.
        hi = ctx + tl.minimum(first + BLOCK_M, q_len)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(ctx + first - window + 1, 0)
        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_table_ptr + chunk.to(tl.int64) * stride_btb
        offs_t = tl.arange(0, TILE)

        for tile_start in range(lo, hi, TILE):
            pos = tile_start + offs_t
            in_range = pos < hi
            block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
            valid = in_range & (block_ids >= 0) & (block_ids < num_blocks)
            token_in_block = (pos % BLOCK_SIZE).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_cache_ptr
                + block_ids[:, None] * stride_kb
                + token_in_block[:, None] * stride_kt
                + kv_head * stride_kh
                + offs_d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            if not NATIVE_DOT:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
            if USE_SOFTCAP:
                # tanh through exp2 (the interpreter has no libdevice); saturates to +-1 cleanly.
                x = scores / softcap
                scores = (1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)) * softcap
            scores = scores * 1.4426950408889634
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # Rows with nothing visible so far keep m = -inf; measure them from 0 so that
            # exp2(-inf - -inf) never happens (their weights stay 0).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(scores - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_cache_ptr
                + block_ids[:, None] * stride_vb
                + token_in_block[:, None] * stride_vt
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            if NATIVE_DOT:
                p = p.to(v.dtype)
            else:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=INPUT_PRECISION)
            m_i = m_new

        denom = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_mask[None, :],
        )


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for one interpreter mode (``interpret`` only keys the cache)."""
    del interpret
    # The window changes from layer to layer (Gemma-2) and must not be specialised on.
    return triton.jit(_prefill_kernel, do_not_specialize=["window"])


def _tile_sizes(group: int, head_dim: int, interpreting: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_M, BLOCK_D, TILE)``: about 64 query rows (tokens x group heads) per program
    on a GPU, 16 under the interpreter (which runs every program in Python)."""
    block_g = _pow2(group)
    block_d = _pow2(head_dim, _MIN_DOT)
    rows = _MIN_DOT if interpreting else 64
    block_m = max(1, rows // block_g)
    block_m = max(block_m, -(-_MIN_DOT // block_g))  # tl.dot needs 16 rows
    tile = _MIN_DOT if interpreting else max(_MIN_DOT, min(64, 4096 // block_d))
    return block_g, block_m, block_d, tile


def triton_varlen_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen prefill over the paged cache; same contract as
    :func:`cbgen.model.kernels.reference.varlen.varlen_prefill_attention`.

    ``max_q_len`` (the longest chunk, a host int) sizes the grid.  ``out``: a ``[Tq, H, D]`` tensor
    of the query's dtype to write into (any strides, unit inner), default a new one.  Returns it."""
    check_varlen(query, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    total, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out: expected {tuple(query.shape)} {query.dtype} with unit inner stride")
    chunks = block_table.shape[0]
    if total == 0 or chunks == 0 or max_q_len <= 0:
        return out
    native_dot = _native_dot(query.dtype, k_cache.dtype)
    if query.dtype != k_cache.dtype:
        query = query.to(k_cache.dtype)
    group = num_heads // num_kv_heads
    interpreting = _interpreting()
    block_g, block_m, block_d, tile = _tile_sizes(group, head_dim, interpreting)
    grid = (chunks, num_kv_heads, -(-int(max_q_len) // block_m))
    with _device_guard(query.device):
        _kernel(interpreting)[grid](
            query,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens_q,
            seq_lens_k,
            out,
            *query.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            block_table.stride(0),
            *out.stride(),
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else 0,
            head_dim,
            num_blocks,
            GROUP=group,
            BLOCK_G=block_g,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            TILE=tile,
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            NATIVE_DOT=native_dot,
            INPUT_PRECISION="tf32" if native_dot else "ieee",
            num_warps=4,
        )
    return out
