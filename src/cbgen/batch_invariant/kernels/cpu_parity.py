"""Parity mode's CPU kernels: the matrix product (the panel GEMM of ``csrc/cpu_panel.c``) and a paged
attention (``csrc/cpu_parity.c``) whose every output element is computed in one fixed order,
whatever the batch, the tiling, the threads or the origin of the keys (see the C files).  Both sides of parity mode, the engine and
``cbgen.parity(model)``, call these, so their results are equal bit for bit.

The wrappers check shapes, dtypes, strides and devices here, and the C side checks every index
(rows, positions, blocks) before touching memory.  The C files are in ``cbgen/model/kernels/cpu/csrc/``,
built with the other C kernels by :mod:`cbgen.model.kernels.cpu.ops`.
"""

from __future__ import annotations

import functools

import torch

from cbgen.model.kernels.arg_checks import check_rows
from cbgen.model.kernels.cpu.ops import available, library
from cbgen.model.kernels.cpu.panel import (
    panel512_available,
    panel512_linear,
    panel512_pack,
    panel_available,
    panel_linear,
    panel_pack,
)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_RC = {1: "rejected its sizes", 2: "was given an index out of range", 3: "could not allocate its scratch"}


@functools.cache
def _runs_here() -> bool:
    # The build and the probe GEMM run once: every matrix product of a parity forward asks.
    return available() and panel_available()


def parity_kernels_available(dtype: torch.dtype) -> bool:
    """Whether the C parity kernels run here for ``dtype``: the kernels built, for a CPU with AVX2
    and FMA (the panel GEMM's), float32 or bfloat16."""
    return dtype in _DTYPES and _runs_here()


@functools.cache
def _pairs_run_here() -> bool:
    return panel512_available(torch.bfloat16)


def _uses_pairs(dtype: torch.dtype) -> bool:
    # bfloat16 products on AVX512-BF16 CPUs: the pair GEMM (the vdpbf16ps GEMM of csrc/cpu_panel512.c,
    # without a bias); everything else: the float32 panel GEMM.
    return dtype == torch.bfloat16 and _pairs_run_here()


def gemm_name(dtype: torch.dtype) -> str:
    """Which GEMM parity products of ``dtype`` run on here (for the execution plan's line)."""
    return "pair GEMM (vdpbf16ps)" if _uses_pairs(dtype) else "panel GEMM"


def parity_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` packed for :func:`parity_linear` on products of its dtype (exact: the values
    are only rearranged, or widened)."""
    return panel512_pack(weight) if _uses_pairs(weight.dtype) else panel_pack(weight)


def parity_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` (one dtype, float32 or bfloat16) from ``packed =
    parity_pack(weight)`` when given, else packing ``weight`` for this call.  Each output element is
    one fixed chain over k whatever M, rounded once to x's dtype: for bfloat16 on a CPU with
    AVX512-BF16, ``vdpbf16ps`` steps over the k pairs in order (``csrc/cpu_panel512.c``); otherwise
    the panel GEMM's fused multiply-adds over k = 0, 1, ..., K - 1 in float32 (``csrc/cpu_panel.c``:
    one accumulator lane per element, K never split)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"parity_linear: expected x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    rows, k = x.shape
    n = weight.shape[0]
    if packed is None:
        packed = parity_pack(weight) if rows and n and k else None
    return parity_linear_packed(x, packed, n)


def parity_linear_packed(x: torch.Tensor, packed: torch.Tensor | None, n: int) -> torch.Tensor:
    """:func:`parity_linear` from ``packed = parity_pack(weight)`` of a weight with ``n`` rows.
    Each output element's chain depends on its own column of the weight only, so a pack of
    concatenated weights (q, k and v) gives each column the bits its own weight's pack gives."""
    rows, k = x.shape
    if rows == 0 or n == 0 or k == 0:
        return x.new_zeros(rows, n)
    if packed is None:
        raise ValueError("parity_linear_packed: no packed weight")
    if _uses_pairs(x.dtype):
        return panel512_linear(x, packed, n)
    return panel_linear(x, packed, n)


def _strides(t: torch.Tensor) -> list[int]:
    """``t``'s strides with those of size-1 dimensions (which torch leaves arbitrary) replaced by the
    packed value, so the kernel's layout checks see what the data actually needs."""
    strides = list(t.stride())
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1:
            strides[i] = 1 if i == t.dim() - 1 else strides[i + 1] * t.shape[i + 1]
    return strides


def _index(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if t.shape != shape or t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {list(shape)} {dtype} tensor, got {t.dtype} {list(t.shape)}")
    return t.contiguous()


def parity_attention(
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
    Hkv, D]`` (one dtype, float32 or bfloat16): row ``t`` belongs to row ``row_seq[t]`` of
    ``block_table [G, W]`` (int32) and sits at position ``row_pos[t]`` (-1: a padding row, output 0);
    that row's key at position ``j`` is at index ``seq_start[g] + j`` of its blocks.  Causal, with an
    optional sliding window and soft cap; returns ``[T, H, D]`` of q's dtype."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"parity_attention: expected q [T, H, D] and caches [blocks, size, Hkv, D], got {tuple(q.shape)}, {tuple(k_cache.shape)}"
        )
    t, h, d = q.shape
    num_blocks, block_size, kv_heads, kd = k_cache.shape
    dtype = q.dtype
    if dtype not in _DTYPES or k_cache.dtype != dtype or v_cache.dtype != dtype or kd != d:
        raise ValueError(
            f"parity_attention: q and caches must share float32 or bfloat16 and head_dim, got {q.dtype}/{k_cache.dtype}, D {d}/{kd}"
        )
    for name, c in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if c.device.type != "cpu" or (c.stride(-1) != 1 and d > 1):
            raise ValueError(f"parity_attention: {name} must be on the CPU with contiguous head_dim")
    q_strides, kv_strides = _strides(q), _strides(k_cache)
    if kv_strides != _strides(v_cache):
        raise ValueError("parity_attention: k_cache and v_cache must share strides")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.device.type != "cpu":
        raise ValueError(
            f"parity_attention: block_table must be a CPU [G, W] int32 tensor, got {block_table.dtype} {list(block_table.shape)}"
        )
    block_table = block_table.contiguous()
    groups, width = block_table.shape
    seq_start = _index("seq_start", seq_start, (groups,), torch.int64)
    row_seq = _index("row_seq", row_seq, (t,), torch.int64)
    row_pos = _index("row_pos", row_pos, (t,), torch.int64)
    out = torch.empty(t, h, d, dtype=dtype)
    if t == 0:
        return out
    rc = library().cbgen_parity_attention(
        q.data_ptr(),
        q_strides[0],
        q_strides[1],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_strides[0],
        kv_strides[1],
        kv_strides[2],
        num_blocks,
        block_size,
        block_table.data_ptr(),
        width,
        width,
        groups,
        seq_start.data_ptr(),
        row_seq.data_ptr(),
        row_pos.data_ptr(),
        out.data_ptr(),
        h * d,
        t,
        h,
        kv_heads,
        d,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        _DTYPES[dtype],
    )
    if rc:
        raise ValueError(f"cbgen_parity_attention {_RC.get(rc, rc)} (T {t}, H {h}, Hkv {kv_heads}, D {d})")
    return out


def parity_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probability of ``tokens [R]`` (int64) under each row of ``logits [R, V]`` (CPU,
    float32 or bfloat16, contiguous rows): ``(x[tok] - max) - log(sum(exp(x - max)))``, the sum in
    one order set by ``V`` alone (``csrc/cpu_parity.c``).  Returns float32 ``[R]``."""
    if logits.dim() != 2 or logits.dtype not in _DTYPES or logits.device.type != "cpu":
        raise ValueError(
            f"parity_token_logprobs: logits must be a CPU [R, V] float32 or bfloat16 tensor, got {logits.dtype} {list(logits.shape)}"
        )
    rows, vocab = logits.shape
    check_rows("logits", logits, rows, vocab, logits.dtype)
    tokens = _index("tokens", tokens, (rows,), torch.int64)
    out = torch.empty(rows, dtype=torch.float32)
    if rows == 0:
        return out
    stride = logits.stride(0) if rows > 1 else vocab
    rc = library().cbgen_parity_token_logprobs(
        logits.data_ptr(), stride, rows, vocab, tokens.data_ptr(), out.data_ptr(), _DTYPES[logits.dtype]
    )
    if rc:
        raise ValueError(
            "parity_token_logprobs: "
            + ("a token id is out of range" if rc == 2 else f"rejected its sizes (V={vocab})")
        )
    return out
