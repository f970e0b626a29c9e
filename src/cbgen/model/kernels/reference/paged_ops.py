"""Reference (torch) implementations of the two paged-KV primitives.

Cache layout, shared by every backend: one key and one value tensor per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``.  Token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.  A slot of ``-1`` means "write
nowhere" (padding rows of a CUDA-graph bucket).
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping[T]``."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    store_kv_all_slots(key, value, k_cache, v_cache, slot_mapping)


def store_kv_all_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`store_kv` for slot mappings without ``-1``: no data-dependent filtering, so no host
    sync, which is what a CUDA-graph capture needs (its padding rows write to a scratch block)."""
    flat_k = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    flat_v = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """Gathers each row's blocks into a padded ``[B, Hkv, L, D]`` view (``L`` = blocks x block_size)."""
    num_rows, max_blocks = block_table.shape
    block_size = cache.shape[1]
    out = cache[block_table.long()].view(num_rows, max_blocks * block_size, cache.shape[2], cache.shape[3])
    if max_len is not None:
        out = out[:, :max_len]
    return out.transpose(1, 2)


def decode_mask(seq_lens: torch.Tensor, length: int, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, 1, L]`` mask: key ``j`` is visible to the newest token of a row of length ``n``
    when ``j < n`` and, with a window ``w``, ``j > n - 1 - w``."""
    idx = torch.arange(length, device=seq_lens.device)
    lens = seq_lens.to(torch.long)[:, None]
    mask = idx[None, :] < lens
    if sliding_window is not None:
        mask &= idx[None, :] > (lens - 1 - sliding_window)
    return mask[:, None, None, :]


def hide_masked(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroes the gathered ``[B, Hkv, L, D]`` keys and values that ``mask [B, 1, 1, L]`` hides.

    The padding of a block table points at block 0, which may hold another sequence's K/V, NaN
    included; a -inf score does not stop ``0 * NaN`` in the value sum (nor ``NaN + -inf`` in SDPA's
    masked scores), so hidden entries must not hold NaN at all."""
    hidden = ~mask[:, :, 0, :, None]
    return keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)


def attend_after_context(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx_len: int, scale: float
) -> torch.Tensor | None:
    """Causal attention of a prefill chunk (``query [1, H, Q, D]``) whose first query sits after
    ``ctx_len`` earlier tokens (``key``/``value`` ``[1, Hkv, ctx_len + Q, D]``), on the CPU: two
    flash-attention calls, the context fully visible and the chunk causal, merged by their
    log-sum-exps.  One call with the offset causal mask measured 20-35% slower (SmolLM2, 2,048-token
    chunks at 2k-6k of context, AMD EPYC): the explicit mask is read for every block and no block
    of it is skipped.  None when this torch lacks the op (the caller then masks).

    The op groups query heads over fewer kv heads itself (torch 2.13; checked against SDPA by the
    tests), so the context is not copied once per query head of a group; a torch whose op refuses
    that gets the copies."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or query.device.type != "cpu" or key.shape[-1] != value.shape[-1]:
        return None
    try:
        past, past_lse = op(query, key[:, :, :ctx_len], value[:, :, :ctx_len], 0.0, False, scale=scale)
        own, own_lse = op(query, key[:, :, ctx_len:], value[:, :, ctx_len:], 0.0, True, scale=scale)
    except RuntimeError:
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        past, past_lse = op(query, key[:, :, :ctx_len], value[:, :, :ctx_len], 0.0, False, scale=scale)
        own, own_lse = op(query, key[:, :, ctx_len:], value[:, :, ctx_len:], 0.0, True, scale=scale)
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = (past_lse - top).exp(), (own_lse - top).exp()
    merged = (past.float() * w_past[..., None] + own.float() * w_own[..., None]) / (w_past + w_own)[..., None]
    return merged.to(query.dtype)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Dense attention on ``[B, H, Q, D]`` queries and ``[B, Hkv, K, D]`` keys (GQA by head grouping).

    ``mask`` is boolean (True = visible).  Soft-capping is not supported by SDPA, so that case takes the
    explicit softmax path, computed in float32 like transformers' eager attention.
    """
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal and mask is None,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal and mask is None:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One new token per row: ``query [B, H, D]`` attends to the first ``seq_lens[b]`` cached tokens
    of its row (its own K/V already stored).  Returns ``[B, H, D]``."""
    keys = gather_kv(k_cache, block_table, max_seq_len)
    values = gather_kv(v_cache, block_table, max_seq_len)
    mask = decode_mask(seq_lens, keys.shape[2], sliding_window)
    keys, values = hide_masked(keys, values, mask)
    out = attend(query[:, :, None, :], keys, values, mask, scale, softcap)
    return out[:, :, 0, :]
