"""Varlen prefill: the contract every backend's prefill kernel meets, its torch reference, and the
torch strategy of the reference backend (and of the CPU backend's longer chunks).

The contract (as flash-attn's ``flash_attn_varlen_func`` with a ``block_table``): a step's prefill
chunks are packed one after another, ``query [Tq, H, D]``; chunk ``i`` owns query rows
``cu_seqlens_q[i] .. cu_seqlens_q[i + 1]`` and attends to the first ``seq_lens_k[i]`` tokens of its
sequence, read from the paged cache through ``block_table[i]``, its own K/V included (attention
stores a step's K/V before it attends).  Query ``j`` of a chunk of ``n`` tokens sits at position
``seq_lens_k[i] - n + j`` (bottom-right alignment): it sees keys up to that position, and with a
window ``w`` only the last ``w`` of them.

The torch strategy takes the chunks as host ints (:class:`cbgen.model.attention.PrefillSeq`), so it
never synchronises with a device to find their lengths: :func:`attend_loop`, one SDPA call per chunk
(after earlier context: :func:`attend_after_context`'s two flash calls merged by their log-sum-exps).
One-call alternatives lost to it where measured (``benchmarks/prefill_varlen.py``, AMD EPYC, 2
threads, 256 prompts of 16-48 tokens, 30 layers of SmolLM2-135M): one SDPA call padded to the
longest chunk 2.5 s against 1.2 s a step in float32 (1.72 against 1.71 s in bfloat16), one call
with a block-diagonal causal mask over the packed chunks 43 s (85 s).  The CPU backend attends short
chunks through its C decode kernel instead (0.37 s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cbgen.model.kernels.arg_checks import check_cache
from cbgen.model.kernels.reference.paged_ops import attend, attend_after_context, gather_kv

if TYPE_CHECKING:
    from cbgen.model.attention import PrefillSeq

__all__ = ["attend_loop", "check_varlen", "varlen_prefill_attention"]


def check_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Raises ``ValueError`` naming the argument unless ``query [Tq, H, D]`` (unit inner stride, ``H``
    a multiple of the cache's kv heads), ``block_table [N, W]``, ``cu_seqlens_q [N + 1]`` and
    ``seq_lens_k [N]`` (int32, on the cache's device) fit the cache.  Metadata only: the values are
    the input builder's to check (:mod:`cbgen.model.input_batch`)."""
    _, _, kv_heads, head_dim = check_cache(k_cache, v_cache)
    device = k_cache.device
    if (
        query.dim() != 3
        or query.shape[2] != head_dim
        or query.shape[1] % kv_heads
        or query.stride(2) != 1
        or query.device != device
    ):
        raise ValueError(
            f"query: expected [Tq, H, {head_dim}] with H a multiple of {kv_heads} on {device}, "
            f"got {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    chunks = block_table.shape[0] if block_table.dim() == 2 else -1
    for name, t, shape in (
        ("block_table", block_table, (chunks, block_table.shape[-1])),
        ("cu_seqlens_q", cu_seqlens_q, (chunks + 1,)),
        ("seq_lens_k", seq_lens_k, (chunks,)),
    ):
        if (
            chunks < 0
            or t.shape != shape
            or t.dtype != torch.int32
            or t.device != device
            or t.stride(-1) != 1
        ):
            raise ValueError(
                f"{name}: expected an int32 {list(shape)} tensor with unit inner stride on {device}, "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )


def varlen_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference for the varlen contract (module docstring): one masked dense attention per
    chunk over its keys gathered from the cache.  Reads the lengths on the host: a test oracle,
    not a fast path.  Returns ``[Tq, H, D]`` in ``query.dtype``."""
    check_varlen(query, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts, lens_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for i, k_len in enumerate(lens_k):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys = gather_kv(k_cache, block_table[i : i + 1], k_len)
        values = gather_kv(v_cache, block_table[i : i + 1], k_len)
        mask = _visible(hi - lo, k_len - (hi - lo), k_len, sliding_window, query.device)
        qs = query[lo:hi].transpose(0, 1)[None]
        res = attend(qs, keys.to(query.dtype), values.to(query.dtype), mask, scale, softcap)
        out[lo:hi] = res[0].transpose(0, 1)
    return out


def _visible(
    q_len: int, ctx_len: int, k_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """``[q_len, k_len]``: key ``p`` is visible to query ``j`` (at ``ctx_len + j``) when ``p <=
    ctx_len + j`` and, with a window ``w``, ``p > ctx_len + j - w``."""
    q_pos = torch.arange(ctx_len, ctx_len + q_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attend_loop(
    seqs: Sequence[PrefillSeq],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """One SDPA call per chunk of ``seqs`` into its rows of ``out [T, H, D]`` (``q [T, H, D]`` and the
    step's fresh ``k``/``v [T, Hkv, D]``, any strides; ``block_table`` row ``i`` belongs to
    ``seqs[i]``).  A chunk without context attends its own fresh K/V; one after context gathers
    its keys from the cache."""
    for i, seq in enumerate(seqs):
        end = seq.q_start + seq.q_len
        qs = q[seq.q_start : end].transpose(0, 1)[None]
        if seq.ctx_len == 0:
            ks = k[seq.q_start : end].transpose(0, 1)[None]
            vs = v[seq.q_start : end].transpose(0, 1)[None]
        else:
            total = seq.ctx_len + seq.q_len
            ks = gather_kv(k_cache, block_table[i : i + 1], total)
            vs = gather_kv(v_cache, block_table[i : i + 1], total)
        res = None
        if seq.ctx_len and sliding_window is None and softcap is None:
            res = attend_after_context(qs, ks, vs, seq.ctx_len, scale)
        if res is None:
            mask = None
            if seq.ctx_len or sliding_window is not None:
                mask = _visible(seq.q_len, seq.ctx_len, seq.ctx_len + seq.q_len, sliding_window, q.device)
            res = attend(qs, ks, vs, mask, scale, softcap, is_causal=mask is None)
        out[seq.q_start : end] = res[0].transpose(0, 1)
