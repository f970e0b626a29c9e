"""Parity mode's Triton kernels (the CUDA side of ``LLM(batch_invariant=True)`` and
``cbgen.parity(model)``): a matrix product and a paged attention whose every output element is
reduced in one fixed order, whatever else shares the launch.  They have the contracts of the C
kernels in :mod:`cbgen.batch_invariant.kernels.cpu_parity`; the two sides of parity mode call the same
function on one device, so their results are equal bit for bit.

Where the order comes from:

* Every sum over a reduced dimension is a ``tl.dot`` of fixed tile shapes, with K walked in
  increasing order.  A dot's accumulation order per output element is set by the instruction
  (tensor-core MMA for 16-bit operands; for float32 ``input_precision="ieee"``, one FMA chain over
  k) and is the same for every element of the tile, so an element does not depend on the other
  rows of its tile, nor on where in the tile it sits.  ``tl.sum`` is avoided on purpose: on a GPU
  its tree follows the register layout, which the compiler picks per specialisation (alignment,
  strides); a dot's order does not move with it.
* Tile shapes are module constants, never chosen from the call's shapes, and nothing is split
  across programs (no split-K, no flash-decoding splits), so M (the row count) only changes the
  grid.  Integers that vary from call to call are not specialised on (no recompiles mid-run).
* Maxima are exact in any order; ``exp2`` and division are elementwise.

Kernels are wrapped with ``triton.jit`` lazily, per interpreter mode (see
:mod:`cbgen.model.kernels.triton.ops`), so they also run under ``TRITON_INTERPRET=1`` on CPU
tensors, which is how the tests exercise them.  There the interpreter's ``tl.dot`` is a NumPy
matmul: deterministic too, but not the GPU's bits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cbgen.model.kernels.triton.ops import (
    _device_guard,
    _interpreting,
    _native_dot,
    _pow2,
    available,
    tl,
    triton,
)

__all__ = ["triton_parity_attention", "triton_parity_available", "triton_parity_linear"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Linear tiles.  Fixed: a row's reduction order must not depend on M.  64 x 64 output tiles with
# K steps of 32 keep a float32 FMA tile and a 16-bit MMA tile within 4 warps' registers.
_LIN_BLOCK_M = 64
_LIN_BLOCK_N = 64
_LIN_BLOCK_K = 32
_LIN_WARPS = 4

# Attention: key positions per step.  Block b covers absolute positions [64 b, 64 b + 64), so the
# online softmax's rescaling points depend on positions alone (the same constant as the torch
# core's BLOCK in cbgen.batch_invariant.attention_core).
_ATT_BLOCK_N = 64
# tl.dot's minimum tile edge: a program's GQA group of query heads is padded to it.
_MIN_ROWS = 16
_ATT_WARPS = 4
_MAX_HEAD_DIM = 1024


def triton_parity_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the Triton parity kernels run for tensors of ``dtype`` on ``device``: triton imports
    and the device is CUDA (or ``TRITON_INTERPRET=1`` is set), for float32, bfloat16 or float16."""
    return dtype in _DTYPES and available(device)


# ----------------------------------------------------------------------------------------------
# Kernel bodies (plain functions, jitted lazily by _kernels).
# ----------------------------------------------------------------------------------------------


def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n[None, :] * stride_wn  # weight read as [K, N]: weight^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K in increasing steps, each step one dot accumulated into the running tile: the same chain for
    # every element.  Edge loads pad with zeros, whose products add exact zeros.
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if not NATIVE_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    seq_start_ptr,
    row_seq_ptr,
    row_pos_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_tg,
    stride_tw,
    stride_ot,
    stride_oh,
    stride_od,
    head_dim,
    block_size,
    num_blocks,
    num_groups,
    table_width,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim

    seq = tl.load(row_seq_ptr + row)
    # -1: a padding row.  So is a row whose table row is out of range, should one get past the host
    # checks (skipped under CUDA-graph capture): nothing outside the tensors is read.
    pos_q = tl.load(row_pos_ptr + row)
    pos_q = tl.where((seq >= 0) & (seq < num_groups), pos_q, -1)
    start = tl.load(seq_start_ptr + seq, mask=pos_q >= 0, other=0)
    # Rows past GROUP (padding up to the dot's 16) hold zeros: finite scores, never stored.
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    # Visible keys: positions lo..pos_q.  The blocks walked, lo // BLOCK_N .. pos_q // BLOCK_N, are a
    # function of the query's own position and the window: no caller skips differently.
    lo = pos_q * 0
    if USE_WINDOW:
        lo = tl.maximum(pos_q - window + 1, 0)
    first_block = lo // BLOCK_N
    end_block = (pos_q + BLOCK_N) // BLOCK_N  # cdiv(pos_q + 1, BLOCK_N); 0 for a padding row

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    # The normaliser is a dot with a ones tile (a fixed-order sum over keys, like p @ v); its
    # columns are equal and the max over them picks that value exactly.
    l_i = tl.zeros([BLOCK_G, 16], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, dtype=tl.float32)
    table_row = table_ptr + seq * stride_tg

    for blk in range(first_block, end_block):
        pos = offs_n.to(tl.int64) + blk * BLOCK_N
        index = start + pos  # the key's logical index in its table row
        column = index // block_size
        visible = (pos >= lo) & (pos <= pos_q) & (index >= 0) & (column < table_width)
        cache_block = tl.load(table_row + column * stride_tw, mask=visible, other=0).to(tl.int64)
        # The host checked every needed id; one outside the cache is still never dereferenced
        # (the checks are skipped under CUDA-graph capture).
        visible = visible & (cache_block >= 0) & (cache_block < num_blocks)
        slot = index % block_size
        kv_mask = visible[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr
            + cache_block[:, None] * stride_kb
            + slot[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            # tanh through exp2 (the interpreter has no libdevice); saturates cleanly to +-1.
            z = tl.exp2(scores * (2.0 * 1.4426950408889634 / softcap))
            scores = (1.0 - 2.0 / (z + 1.0)) * softcap
        scores = tl.where(visible[None, :], scores * 1.4426950408889634, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # While nothing is visible yet (only if the table was bad) m stays -inf: measure from 0 so
        # no -inf - -inf NaN appears and the weights stay 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        v = tl.load(
            v_ptr
            + cache_block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        l_i = tl.dot(p, ones, l_i * alpha[:, None], input_precision="ieee")
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new

    norm = tl.max(l_i, axis=1)
    # A padding row walked no block: acc 0 over 1 stores zeros.
    out = acc / tl.where(norm > 0.0, norm, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The jitted kernels for one interpreter mode (``interpret`` only keys the cache)."""
    del interpret
    # Sizes that change from call to call (rows, tables, windows, the trainer's one-block-per-row
    # cache) are not specialised on: no recompiles mid-run.
    linear = triton.jit(_linear_kernel, do_not_specialize=["M"])
    attention = triton.jit(
        _attention_kernel,
        do_not_specialize=[
            "stride_kb",
            "stride_vb",
            "stride_tg",
            "block_size",
            "num_blocks",
            "num_groups",
            "table_width",
            "window",
        ],
    )
    return linear, attention


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _result_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels store: ``dtype``, except bfloat16 under the interpreter, whose float32 to
    bfloat16 cast truncates (Triton 3.9) where CUDA rounds to nearest even; there the kernels store
    float32 and torch rounds it once, as the GPU would."""
    return torch.float32 if dtype == torch.bfloat16 and _interpreting() else dtype


def _check_device(fn: str, tensors: dict[str, torch.Tensor]) -> torch.device:
    device = next(iter(tensors.values())).device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{fn}: {name} is on {t.device}, expected {device} like the others")
    if not available(device):
        raise ValueError(
            f"{fn}: the Triton kernels do not run on {device} (need triton and a CUDA device, "
            "or TRITON_INTERPRET=1 for CPU tensors)"
        )
    return device


def triton_parity_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` -> ``[M, N]`` of x's dtype (float32, bfloat16 or float16, one
    dtype for both; any strides), accumulated in float32.

    Each output element is reduced over K in one order whatever M: 64 x 64 output tiles, K in steps
    of 32 in increasing order, each step one ``tl.dot`` into the running tile (no split-K, tile sizes
    fixed).  So row ``i`` is the same bits whether ``x`` has 1 row or 1000, and whatever rows
    surround it.  float32 takes the exact FMA path (``input_precision="ieee"``, not TF32); 16-bit
    operands go to the tensor cores on CUDA.  Raises ``ValueError`` on bad arguments."""
    fn = "triton_parity_linear"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: expected x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"{fn}: x and weight must share float32, bfloat16 or float16, got {x.dtype}/{weight.dtype}"
        )
    device = _check_device(fn, {"x": x, "weight": weight})
    rows, inner = x.shape
    n = weight.shape[0]
    if rows == 0 or n == 0 or inner == 0:
        return x.new_zeros(rows, n)
    out = torch.empty(rows, n, dtype=_result_dtype(x.dtype), device=device)
    native = _native_dot(x.dtype, weight.dtype)
    linear_kernel, _ = _kernels(_interpreting())
    grid = (triton.cdiv(rows, _LIN_BLOCK_M), triton.cdiv(n, _LIN_BLOCK_N))
    with _device_guard(device):
        linear_kernel[grid](
            x,
            weight,
            out,
            rows,
            n,
            inner,
            *x.stride(),
            *weight.stride(),
            *out.stride(),
            BLOCK_M=_LIN_BLOCK_M,
            BLOCK_N=_LIN_BLOCK_N,
            BLOCK_K=_LIN_BLOCK_K,
            NATIVE_DOT=native,
            INPUT_PRECISION="tf32" if native else "ieee",
            num_warps=_LIN_WARPS,
        )
    return out.to(x.dtype)


def _index(fn: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(
            f"{fn}: {name} must be a {list(shape)} {dtype} tensor, got {t.dtype} {list(t.shape)}"
        )
    return t.contiguous()


def _check_indices(
    fn: str,
    block_table: torch.Tensor,
    seq_start: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    block_size: int,
    num_blocks: int,
    window: int,
) -> None:
    """Every row's table row and position, and every block id a live row reads, in range: the
    checks of the C kernel, as tensor ops on the indices' device and one read back to the host."""
    groups, width = block_table.shape
    bad_seq = (row_seq < 0) | (row_seq >= groups)
    live = (row_pos >= 0) & ~bad_seq
    seq = torch.where(live, row_seq, 0)
    pos = torch.where(live, row_pos, 0)
    start = seq_start[seq]
    lo = (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)
    first, last = start + lo, start + pos
    bad_pos = live & ((start < 0) | (last >= width * block_size))
    # Table entries read by some live row: +1 at each row's first block, -1 past its last, summed
    # along the row (the rows' block ranges may overlap or leave gaps).
    ok = live & ~bad_pos
    marks = torch.zeros(groups, width + 1, dtype=torch.int32, device=block_table.device)
    one = ok.to(torch.int32)
    marks.index_put_((seq, torch.where(ok, first // block_size, 0)), one, accumulate=True)
    marks.index_put_((seq, torch.where(ok, last // block_size + 1, 0)), -one, accumulate=True)
    needed = marks[:, :width].cumsum(1) > 0
    bad_block = needed & ((block_table < 0) | (block_table >= num_blocks))
    flags = torch.stack([bad_seq.any(), (row_pos < -1).any(), bad_pos.any(), bad_block.any()]).tolist()
    problems = [
        f"row_seq outside [0, {groups})",
        "row_pos below -1",
        f"a key position outside its table row (seq_start + position >= {width} x {block_size}, or seq_start < 0)",
        f"a block id read by some row outside [0, {num_blocks})",
    ]
    found = [what for flag, what in zip(flags, problems) if flag]
    if found:
        raise ValueError(f"{fn}: " + "; ".join(found))


def _check_shapes(
    fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[int, int, int, int, int, int]:
    """Ranks, dtypes and head counts of the attention's tensors; returns (T, H, D, blocks, block
    size, Hkv)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{fn}: expected q [T, H, D] and caches [blocks, size, Hkv, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    t, h, d = q.shape
    num_blocks, block_size, kv_heads, kd = k_cache.shape
    dtype = q.dtype
    if dtype not in _DTYPES or k_cache.dtype != dtype or v_cache.dtype != dtype or kd != d:
        raise ValueError(
            f"{fn}: q and caches must share float32, bfloat16 or float16 and head_dim, got "
            f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}, D {d}/{kd}"
        )
    if kv_heads < 1 or h < 1 or h % kv_heads or d < 1 or d > _MAX_HEAD_DIM:
        raise ValueError(
            f"{fn}: need H a multiple of Hkv >= 1 and 1 <= D <= {_MAX_HEAD_DIM}, got H {h}, Hkv {kv_heads}, D {d}"
        )
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            f"{fn}: block_table must be a [G, W] int32 tensor, got {block_table.dtype} {list(block_table.shape)}"
        )
    return t, h, d, num_blocks, block_size, kv_heads


def triton_parity_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_start: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query rows ``q [T, H, D]`` over paged keys and values ``[num_blocks, block_size,
    Hkv, D]`` (one dtype: float32, bfloat16 or float16; any strides): row ``t`` belongs to row
    ``row_seq[t]`` of ``block_table [G, W]`` (int32) and sits at position ``row_pos[t]`` (-1: a
    padding row, output 0); that row's key at position ``j`` is at index ``seq_start[g] + j`` of its
    blocks.  Causal, with an optional sliding window (keys ``j > p - window``; 0 or None: none) and
    soft cap (``c * tanh(s / c)``; 0 or None: none); GQA.  Returns ``[T, H, D]`` of q's dtype.  The
    contract of :func:`cbgen.batch_invariant.kernels.cpu_parity.parity_attention`.

    A query's output depends only on its vector, its position and the keys and values at its
    visible positions: one program per (row, kv head) walks blocks of 64 absolute key positions in
    increasing order (from the window's first block to the query's), scores and weighted values
    as fixed-order float32 dots, with an online softmax whose rescaling points are those block
    boundaries.  Which rows share the call, and how the cache's blocks are laid out, change nothing.
    Simple rather than fast: a program handles one query token (its GQA heads padded to 16 rows),
    all in float32 FMA dots.

    Arguments are checked before the launch (``ValueError``); the index checks read one flag back
    from the device (skipped during CUDA-graph capture, where the kernel still never dereferences an
    id outside the cache)."""
    fn = "triton_parity_attention"
    t, h, d, num_blocks, block_size, _ = _check_shapes(fn, q, k_cache, v_cache, block_table)
    dtype = q.dtype
    groups, width = block_table.shape
    seq_start = _index(fn, "seq_start", seq_start, (groups,), torch.int64)
    row_seq = _index(fn, "row_seq", row_seq, (t,), torch.int64)
    row_pos = _index(fn, "row_pos", row_pos, (t,), torch.int64)
    device = _check_device(
        fn,
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_table": block_table,
            "seq_start": seq_start,
            "row_seq": row_seq,
            "row_pos": row_pos,
        },
    )
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    if window < 0:
        raise ValueError(f"{fn}: sliding_window must be positive (or 0/None: none), got {sliding_window}")
    if t == 0:
        return torch.empty(t, h, d, dtype=dtype, device=device)
    if groups < 1 or width < 1 or num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"{fn}: empty table or cache (table {groups} x {width}, cache {num_blocks} x {block_size})"
        )
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _check_indices(fn, block_table, seq_start, row_seq, row_pos, block_size, num_blocks, window)

    args = (q, k_cache, v_cache, block_table, seq_start, row_seq, row_pos)
    return _launch_attention(args, float(scale), window, cap, device)


def _launch_attention(
    args: tuple[torch.Tensor, ...], scale: float, window: int, cap: float, device: torch.device
) -> torch.Tensor:
    """Launches the attention kernel on checked arguments (q, caches, table, seq_start, row_seq,
    row_pos); one program per (query row, kv head)."""
    q, k_cache, v_cache, block_table, seq_start, row_seq, row_pos = args
    t, h, d = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    groups, width = block_table.shape
    dtype = q.dtype
    group = h // kv_heads
    out = torch.empty(t, h, d, dtype=_result_dtype(dtype), device=device)
    _, attention_kernel = _kernels(_interpreting())
    with _device_guard(device):
        attention_kernel[(t, kv_heads)](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_start,
            row_seq,
            row_pos,
            out,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *block_table.stride(),
            *out.stride(),
            d,
            block_size,
            num_blocks,
            groups,
            width,
            scale,
            cap if cap > 0.0 else 1.0,
            window,
            GROUP=group,
            BLOCK_G=_pow2(group, _MIN_ROWS),
            BLOCK_D=_pow2(d, _MIN_ROWS),
            BLOCK_N=_ATT_BLOCK_N,
            USE_WINDOW=window > 0,
            USE_SOFTCAP=cap > 0.0,
            num_warps=_ATT_WARPS,
        )
    return out.to(dtype)
