"""Triton kernels for the two paged-KV primitives (the CUDA fast path).

Same contracts and cache layout as :mod:`cbgen.model.kernels.reference.paged_ops`, which stays the reference and the
fallback: callers check :func:`available` and otherwise use the torch functions.

Design notes:

* ``store_kv`` is one program per token that copies all of its KV heads, so a padding token
  (slot ``-1``) costs a single masked-off program instead of a host-side filter (no device sync,
  so it stays CUDA-graph safe).
* Decode attention runs one program per (row, kv-head, split).  A program owns every query head of
  its GQA group, so each K/V tile is read from memory once per group rather than once per query
  head.  The group is padded to 16 rows because ``tl.dot`` needs 16x16 tiles; decode is
  bandwidth-bound, so the wasted tensor-core work is free.
* Each program walks only the live token range of its row (sliding window start .. ``seq_len``),
  gathering token addresses through the block table a tile at a time with an online softmax in
  float32.  Block-table entries past a row's length are never loaded.
* Small batches leave most SMs idle with one program per (row, kv-head), so on CUDA the token range
  is split across several programs (flash-decoding) and a second kernel merges the partial
  softmax states.  The split count depends only on tensor shapes, never on ``seq_lens`` values, so
  it is fixed under CUDA-graph capture.

Kernels are wrapped with ``triton.jit`` lazily, per interpreter mode, because triton decides
between compiling and interpreting when a function is decorated: importing this module before
``TRITON_INTERPRET=1`` is set must not lock CPU callers out of the interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from cbgen import envs
from cbgen.model.kernels.arg_checks import check_decode, check_store

try:
    import triton
    import triton.language as tl

    HAS_TRITON: bool = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "available", "triton_paged_decode_attention", "triton_store_kv"]

_LOG2E = 1.4426950408889634
# tl.dot's minimum tile edge on NVIDIA tensor cores.
_MIN_DOT = 16
# A split shorter than this spends more on writing/merging partials than it saves.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return envs.flag("TRITON_INTERPRET")


def available(device: torch.device | str) -> bool:
    """Whether the triton kernels can run on ``device``.

    True when triton is importable and either ``device`` is CUDA or ``TRITON_INTERPRET=1`` is set
    (the interpreter runs on CPU tensors, slowly; it is meant for tests).
    """
    if not HAS_TRITON:
        return False
    return torch.device(device).type == "cuda" or _interpreting()


# ----------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; see _kernels for why they are not decorated here).
# ----------------------------------------------------------------------------------------------


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    num_slots,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot zeroes the head bound, so padding tokens never touch the cache; so does a slot
    # past the cache (the engine never builds one, and a bad one must not write out of bounds).
    live_heads = tl.where((slot >= 0) & (slot < num_slots), num_kv_heads, 0)
    mask = (offs_h[:, None] < live_heads) & (offs_d[None, :] < head_dim)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    src_k = (
        key_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    )
    src_v = (
        value_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    )
    dst_k = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kct
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    dst_v = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vct
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
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
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_mb,
    stride_mh,
    scale,
    softcap,
    window,
    max_tokens,
    num_splits,
    head_dim,
    num_blocks,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim

    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    # Live range [lo, hi): the reference masks by seq_len but also truncates to the gathered length,
    # and the window start is measured from the untruncated length.
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    hi = tl.minimum(seq_len, max_tokens)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    span = tl.maximum(hi - lo, 0)
    # Splits are tile-aligned so only the last tile of a split can be partial.
    per_split = tl.cdiv(tl.cdiv(span, num_splits), TILE) * TILE
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + row.to(tl.int64) * stride_btb

    # Every tile starts below `end`, so each iteration has at least one visible key and m_i becomes
    # finite on the first pass (no -inf - -inf NaNs).
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs_t
        valid = pos < end
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        # A block id outside the cache is never dereferenced (the engine checks tables on the host).
        valid = valid & (block_ids >= 0) & (block_ids < num_blocks)
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
            # tanh via exp keeps to core ops (the interpreter has no libdevice); saturates cleanly
            # to +-1 when exp overflows or underflows.
            x = scores / softcap
            scores = (1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)) * softcap
        # Work in base 2 so the exponentials are exp2.
        scores = scores * 1.4426950408889634
        scores = tl.where(valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
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

    out_mask = g_mask[:, None] & d_mask[None, :]
    out_ptrs = (
        out_ptr
        + row * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + offs_d[None, :] * stride_od
    )
    if WRITE_PARTIAL:
        tl.store(out_ptrs, acc, mask=out_mask)
        ml_off = row * stride_mb + heads * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=g_mask)
        tl.store(l_ptr + ml_off, l_i, mask=g_mask)
    else:
        # An empty row (padding, seq_len 0) has l == 0 and acc == 0: dividing by 1 yields zeros.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _merge_kernel(
    partial_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ob,
    stride_oh,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim

    ml_off = row * stride_mb + head * stride_mh + offs_s
    m = tl.load(m_ptr + ml_off, mask=s_mask, other=float("-inf"))
    lse = tl.load(l_ptr + ml_off, mask=s_mask, other=0.0)
    acc = tl.load(
        partial_ptr + row * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    # All splits empty (seq_len 0): pin the reference max so exp2 gives 0 weights, not NaN.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    weights = tl.exp2(m - m_ref)
    denom = tl.sum(weights * lse, axis=0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """The jitted kernels for one interpreter mode (``interpret`` only keys the cache)."""
    del interpret
    # Values that change from step to step must not be specialised on (divisible-by-16 / == 1),
    # or a new length could trigger a recompile in the middle of serving or of a graph capture.
    decode = triton.jit(_decode_kernel, do_not_specialize=["window", "max_tokens", "num_splits"])
    merge = triton.jit(_merge_kernel, do_not_specialize=["num_splits"])
    return triton.jit(_store_kv_kernel), decode, merge


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_guard(device: torch.device) -> Any:
    # Triton launches on the current CUDA device, which need not be the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping[T]``.

    Same contract as :func:`cbgen.model.kernels.reference.paged_ops.store_kv`: caches are
    ``[num_blocks, block_size, Hkv, D]``, slot ``s`` is block ``s // block_size`` offset
    ``s % block_size``, and slots ``< 0`` are skipped.  Inputs may be strided views.
    """
    check_store(key, value, k_cache, v_cache, slot_mapping, slot_dtype=None, strided=True)
    if key.dim() != 3:
        raise ValueError(f"key/value must be [T, Hkv, D]; got {tuple(key.shape)}")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    # Cast on the host so rounding matches the reference bit for bit (and the kernel stays a copy).
    if key.dtype != k_cache.dtype:
        key = key.to(k_cache.dtype)
    if value.dtype != v_cache.dtype:
        value = value.to(v_cache.dtype)
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    store_kernel, _, _ = _kernels(_interpreting())
    with _device_guard(key.device):
        store_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            *key.stride(),
            *value.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            num_kv_heads,
            head_dim,
            k_cache.shape[0] * k_cache.shape[1],
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_H=_pow2(num_kv_heads),
            BLOCK_D=_pow2(head_dim),
        )


def _choose_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    # Only shapes go in, so the choice is stable across CUDA-graph replays of one bucket.
    if device.type != "cuda" or _interpreting():
        return 1
    programs = batch * num_kv_heads
    wanted = -(
        -2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) // programs
    )
    worthwhile = max(1, max_tokens // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worthwhile, _MAX_SPLITS))


def _native_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` gets the 16-bit operands as they are (tensor cores on CUDA): for a query in
    the cache's 16-bit dtype.  The interpreter's ``tl.dot`` is exact on float16 but returns garbage on
    bfloat16 (Triton 3.9; pinned by a test), so CPU tests reach this branch in float16 only."""
    if query_dtype != cache_dtype or query_dtype == torch.float32:
        return False
    return not _interpreting() or query_dtype == torch.float16


def triton_paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; same contract as
    :func:`cbgen.model.kernels.reference.paged_ops.paged_decode_attention`.

    ``query [B, H, D]`` attends to the first ``seq_lens[b]`` cached tokens of its row (restricted
    to the last ``sliding_window`` of them if given, scores soft-capped by ``softcap`` if given).
    Rows with ``seq_lens == 0`` return zeros.  ``num_splits`` overrides the flash-decoding split
    count (default: chosen from shapes; 1 off CUDA).  Returns ``[B, H, D]`` in ``query.dtype``.
    """
    check_decode(query, k_cache, v_cache, block_table, seq_lens, index_dtype=None)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # The kernel indexes both with unit inner stride.
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if seq_lens.stride(0) != 1:
        seq_lens = seq_lens.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out

    max_tokens = block_table.shape[1] * block_size
    if max_seq_len is not None:
        max_tokens = min(max_tokens, int(max_seq_len))
    if num_splits is None:
        num_splits = _choose_splits(batch, num_kv_heads, max_tokens, query.device)
    num_splits = max(1, int(num_splits))
    native_dot = _native_dot(query.dtype, k_cache.dtype)
    if query.dtype != k_cache.dtype:
        # Mixed precision would need per-operand casts in the kernel; it is not a real deployment.
        query = query.to(k_cache.dtype)
    _launch_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        scale,
        sliding_window,
        softcap,
        max_tokens,
        num_splits,
        native_dot,
    )
    return out


def _launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_tokens: int,
    num_splits: int,
    native_dot: bool,
) -> None:
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim, _MIN_DOT)
    # Bigger tiles amortise the loop, bounded so K/V tiles stay within the register budget.
    tile = max(_MIN_DOT, min(64, 4096 // block_d))
    _, decode_kernel, merge_kernel = _kernels(_interpreting())

    if num_splits > 1:
        target = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        m_buf = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        l_buf = torch.empty_like(m_buf)
        stride_ob, stride_oh, stride_os, stride_od = target.stride()
        stride_mb, stride_mh = m_buf.stride(0), m_buf.stride(1)
    else:
        target, m_buf, l_buf = out, out, out
        stride_ob, stride_oh, stride_od = out.stride()
        stride_os, stride_mb, stride_mh = 0, 0, 0

    with _device_guard(query.device):
        decode_kernel[(batch, num_kv_heads, num_splits)](
            query,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            target,
            m_buf,
            l_buf,
            *query.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            block_table.stride(0),
            stride_ob,
            stride_oh,
            stride_os,
            stride_od,
            stride_mb,
            stride_mh,
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else 0,
            max_tokens,
            num_splits,
            head_dim,
            num_blocks,
            GROUP=group,
            BLOCK_G=_pow2(group, _MIN_DOT),
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            TILE=tile,
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            WRITE_PARTIAL=num_splits > 1,
            NATIVE_DOT=native_dot,
            INPUT_PRECISION="tf32" if native_dot else "ieee",
            num_warps=4,
        )
        if num_splits > 1:
            _merge(merge_kernel, target, m_buf, l_buf, out, num_splits, block_d)


def _merge(merge_kernel: Any, target, m_buf, l_buf, out: torch.Tensor, num_splits: int, block_d: int) -> None:
    """Combines the per-split partial results of a flash-decoding launch into ``out``."""
    batch, num_heads, head_dim = out.shape
    merge_kernel[(batch, num_heads)](
        target,
        m_buf,
        l_buf,
        out,
        target.stride(0),
        target.stride(1),
        target.stride(2),
        m_buf.stride(0),
        m_buf.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        head_dim,
        BLOCK_S=_pow2(num_splits),
        BLOCK_D=block_d,
    )
