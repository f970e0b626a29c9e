"""Paged attention, plugged into transformers through ``AttentionInterface``.

The batch metadata travels as a keyword argument of the model call (``cbgen_meta``), which
transformers forwards to every attention call.  Nothing is stored on the model: paged-ness belongs
to the call, so a plain forward or a training step on the same module is unaffected.

Packed layout of one step: ``T`` tokens in one row (batch dimension 1).  The first
``num_decode`` tokens are single-token rows (decodes, or a prompt's last token after a prefix-cache
hit); after them come prefill chunks, one contiguous run of query tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from cbgen.model import paged_ops

ATTN_NAME = "cbgen_paged"


@dataclass
class PrefillSeq:
    """One prefill chunk: query tokens ``[q_start, q_start + q_len)`` of the packed batch, whose
    sequence already has ``ctx_len`` tokens in the cache."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor | None  # [num_blocks] int, only set when ctx_len > 0 and not as_rows
    as_rows: bool = False  # attended by the decode kernel, one row per query token (see below)


@dataclass
class AttentionMetadata:
    """Everything the attention function needs for one step; built fresh by the input builder."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int
    decode_block_table: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [Bd] int32, context length including the new token
    decode_max_len: int
    prefills: list[PrefillSeq]
    # Short prefill chunks attended as decode rows: query token i of a chunk whose sequence already
    # has c cached tokens is a row with context length c + i + 1, so causality comes from the length
    # alone.  One kernel call then replaces a per-sequence SDPA call (its fixed cost dominates short
    # chunks).  Set by the input builder only when the backend has a decode kernel.
    row_prefill_idx: torch.Tensor | None = None  # [N] int64 positions in the packed batch
    row_prefill_table: torch.Tensor | None = None  # [N, W] int32
    row_prefill_lens: torch.Tensor | None = None  # [N] int32
    row_prefill_max_len: int = 0
    decode_fn: object | None = None  # optional fused decode kernel with paged_decode_attention's signature
    store_fn: object | None = None  # optional fused KV-store kernel with store_kv's signature
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, length: int, sliding_window: int | None) -> torch.Tensor:
        """Decode visibility mask, built once per step and window size and shared by all layers."""
        key = (length, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            mask = paged_ops.decode_mask(self.decode_seq_lens, length, sliding_window)
            self._masks[key] = mask
        return mask


def _prefill_mask(
    q_len: int, ctx_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Causal (and windowed) mask for a chunk whose first query sits at absolute position ``ctx_len``."""
    if ctx_len == 0 and sliding_window is None:
        return None  # plain causal: let SDPA use is_causal
    q_pos = torch.arange(ctx_len, ctx_len + q_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len + q_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache for the packed batch described by ``kwargs['cbgen_meta']``.

    ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``.  Returns ``[1, T, H, D]``.
    """
    meta: AttentionMetadata | None = kwargs.get("cbgen_meta")
    if meta is None:
        raise _no_metadata_error()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    k_cache, v_cache = meta.kv_caches[layer]

    q = query[0].transpose(0, 1)  # [T, H, D]
    (meta.store_fn or paged_ops.store_kv)(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )

    nd = meta.num_decode
    if not meta.prefills:
        out = _decode(meta, q, k_cache, v_cache, scale, sliding_window, softcap)
        return out[None], None

    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(meta, q[:nd], k_cache, v_cache, scale, sliding_window, softcap)
    if meta.row_prefill_idx is not None:
        idx = meta.row_prefill_idx
        out[idx] = meta.decode_fn(
            q.index_select(0, idx),
            k_cache,
            v_cache,
            meta.row_prefill_table,
            meta.row_prefill_lens,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            max_seq_len=meta.row_prefill_max_len,
        )
    attend_prefill_chunks(meta, query, key, value, k_cache, v_cache, scale, sliding_window, softcap, out)
    return out[None], None


def attend_prefill_chunks(
    meta: AttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """SDPA for each prefill chunk of the step that is not attended as decode rows, into its rows of
    ``out [T, H, D]`` (``query [1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``; the chunk's KV is
    already in the cache)."""
    for seq in meta.prefills:
        if seq.as_rows:
            continue
        end = seq.q_start + seq.q_len
        qs = query[:, :, seq.q_start : end]
        if seq.ctx_len == 0:
            ks = key[:, :, seq.q_start : end]
            vs = value[:, :, seq.q_start : end]
        else:
            total = seq.ctx_len + seq.q_len
            ks = paged_ops.gather_kv(k_cache, seq.block_table[None], total)
            vs = paged_ops.gather_kv(v_cache, seq.block_table[None], total)
        mask = _prefill_mask(seq.q_len, seq.ctx_len, sliding_window, query.device)
        res = paged_ops.attend(qs, ks, vs, mask, scale, softcap, is_causal=mask is None)
        out[seq.q_start : end] = res[0].transpose(0, 1)


def _decode(meta, q, k_cache, v_cache, scale, sliding_window, softcap) -> torch.Tensor:
    if meta.decode_fn is not None:
        return meta.decode_fn(
            q,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            max_seq_len=meta.decode_max_len,
        )
    keys = paged_ops.gather_kv(k_cache, meta.decode_block_table, meta.decode_max_len)
    values = paged_ops.gather_kv(v_cache, meta.decode_block_table, meta.decode_max_len)
    mask = meta.decode_mask(keys.shape[2], sliding_window)
    return paged_ops.attend(q[:, :, None, :], keys, values, mask, scale, softcap)[:, :, 0, :]


def _no_metadata_error() -> RuntimeError:
    return RuntimeError(
        "cbgen's paged attention was called without cbgen metadata: the model was used from another "
        "thread while a cbgen step was running. Run training and generation from one thread, or use "
        "LLM.pause() around training steps."
    )


_registered = False


def register() -> str:
    """Registers the paged attention function with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, paged_attention_forward)
        _registered = True
    return ATTN_NAME
