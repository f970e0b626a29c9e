"""Paged attention with attention sinks (gpt-oss and its relatives): each head has a learned logit
that joins every query's softmax as one more key with no value, so a query can put weight on
"nothing".  The paged kernels do not take that term, so the steps of such a model attend here, in
torch, one sequence at a time, with the softmax in float32 over the scores and the sink together
(the sink absorbs its share of the mass; its column is dropped before the value sum)."""

from __future__ import annotations

import torch

from cbgen.model.kernels.reference.paged_ops import gather_kv
from cbgen.model.kernels.reference.varlen import _visible


def _attend_with_sink(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``q [Q, H, D]`` (positions ``ctx_len ..``) over ``keys``/``values`` ``[1, Hkv, K, D]``."""
    num_heads = q.shape[1]
    groups = num_heads // keys.shape[1]
    k = keys[0].repeat_interleave(groups, dim=0).to(q.dtype)  # [H, K, D]
    v = values[0].repeat_interleave(groups, dim=0).to(q.dtype)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)).float() * scale  # [H, Q, K]
    visible = _visible(q.shape[0], ctx_len, k.shape[1], sliding_window, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().reshape(num_heads, 1, 1).expand(num_heads, q.shape[0], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    # Hidden keys may come from block 0's padding: their weight is exactly 0, but 0 * NaN is not.
    v = v.masked_fill(~visible.any(0)[None, :, None], 0.0)
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)  # [Q, H, D]


def paged_sink_attention(
    meta,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of every row of the packed step (``q [T, H, D]``, decode rows first, then the
    prefill chunks of ``meta``) over the paged cache, K/V of this step already stored; ``[T, H, D]``."""
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    nd = meta.num_decode
    if nd:
        lens = meta.decode_seq_lens.tolist()
        for row, length in enumerate(lens):
            keys = gather_kv(k_cache, meta.decode_block_table[row : row + 1], length)
            values = gather_kv(v_cache, meta.decode_block_table[row : row + 1], length)
            out[row : row + 1] = _attend_with_sink(
                q[row : row + 1], keys, values, length - 1, scale, sliding_window, sinks
            )
    for i, seq in enumerate(meta.prefills):
        total = seq.ctx_len + seq.q_len
        table = meta.varlen.block_table[i : i + 1]
        keys, values = gather_kv(k_cache, table, total), gather_kv(v_cache, table, total)
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        out[rows] = _attend_with_sink(q[rows], keys, values, seq.ctx_len, scale, sliding_window, sinks)
    return out
