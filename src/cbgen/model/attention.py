"""Paged attention, plugged into transformers through ``AttentionInterface``.

The batch metadata travels as a keyword argument of the model call (``cbgen_meta``), which
transformers forwards to every attention call.  Nothing is stored on the model: paged-ness belongs
to the call, so a plain forward or a training step on the same module is unaffected.

Packed layout of one step: ``T`` tokens in one row (batch dimension 1).  The first
``num_decode`` tokens are single-token rows (decodes, or a prompt's last token after a prefix-cache
hit); after them come prefill chunks, one contiguous run of query tokens per sequence.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from cbgen.model.kernels.reference import paged_ops

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
    # The engine's backend; the runner sets it before every forward (the builder does not know it).
    backend: AttentionBackend | None = None
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, length: int, sliding_window: int | None) -> torch.Tensor:
        """Decode visibility mask, built once per step and window size and shared by all layers."""
        key = (length, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            mask = paged_ops.decode_mask(self.decode_seq_lens, length, sliding_window)
            self._masks[key] = mask
        return mask


class AttentionBackend:
    """How one device path attends over the paged cache; one object per engine, chosen at start.

    :func:`paged_attention_forward` calls it once per layer through ``meta.backend``.  The defaults
    are the torch reference of :mod:`cbgen.model.kernels.reference.paged_ops`; :mod:`cbgen.model.backends` holds one
    subclass per device path and :func:`cbgen.model.backends.select_backend`.  It lives here, next to
    the metadata that carries it, because each refers to the other.

    ``store_kv`` and ``decode_kernel`` are plain function attributes rather than methods: the
    attention function calls them every layer, and a method wrapping a kernel would add a Python
    frame per call.
    """

    name: str = "torch"
    # Prefill chunks of at most this many tokens are attended by ``decode_kernel``, one row per query
    # token (see AttentionMetadata.row_prefill_*); 0 = never.
    row_prefill_max: int = 0
    # Whether ``decode`` reads each row's length from ``seq_lens`` (a paged kernel), so a fixed-shape
    # decode step does not bake the block-table width in (see cbgen.model.graphs).
    paged_decode: bool = False

    def __init__(self) -> None:
        # ``store_kv(key, value, k_cache, v_cache, slot_mapping)``, as paged_ops.store_kv.
        self.store_kv = paged_ops.store_kv
        # ``decode_kernel(query, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=,
        # softcap=, max_seq_len=)``, as paged_ops.paged_decode_attention.
        self.decode_kernel = paged_ops.paged_decode_attention

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check_geometry(self, block_size: int, head_dim: int) -> None:
        """Raises ``ValueError`` when the KV cache's block or head size does not suit this backend."""

    def cuda_graphs_ok(self, device: torch.device) -> bool:
        """Whether decode steps on ``device`` may be captured in CUDA graphs (logs why not)."""
        return True

    def fixed_shape(self) -> AttentionBackend:
        """This backend as fixed-shape decode steps (padded buckets, CUDA graphs) run it: without host
        syncs, given :meth:`pad_slot`'s padding.  The reference store filters slots of -1 on the
        host, so padding rows write to a real slot instead and this variant stores every slot."""
        fixed = copy.copy(self)
        fixed.store_kv = paged_ops.store_kv_all_slots
        return fixed

    def pad_slot(self, scratch_slot: int) -> int:
        """The slot padding rows of a fixed-shape decode step write their KV to (see
        :meth:`fixed_shape`); -1 for a store that skips such rows itself."""
        return scratch_slot

    def decode(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention ``[B, H, D]`` of the step's decode rows ``q [B, H, D]`` (their KV stored)."""
        keys = paged_ops.gather_kv(k_cache, meta.decode_block_table, meta.decode_max_len)
        values = paged_ops.gather_kv(v_cache, meta.decode_block_table, meta.decode_max_len)
        mask = meta.decode_mask(keys.shape[2], sliding_window)
        keys, values = paged_ops.hide_masked(keys, values, mask)
        return paged_ops.attend(q[:, :, None, :], keys, values, mask, scale, softcap)[:, :, 0, :]

    def prefill(
        self,
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
        """SDPA for each prefill chunk of the step that is not attended as decode rows, into its rows
        of ``out [T, H, D]`` (``query [1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``; the
        chunk's KV is already in the cache)."""
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
            res = None
            if seq.ctx_len and sliding_window is None and softcap is None:
                res = paged_ops.attend_after_context(qs, ks, vs, seq.ctx_len, scale)
            if res is None:
                mask = _prefill_mask(seq.q_len, seq.ctx_len, sliding_window, query.device)
                res = paged_ops.attend(qs, ks, vs, mask, scale, softcap, is_causal=mask is None)
            out[seq.q_start : end] = res[0].transpose(0, 1)


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
    """Attention over the paged cache for the packed batch described by ``kwargs['cbgen_meta']``,
    through its backend.

    ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``.  Returns ``[1, T, H, D]``.
    """
    meta: AttentionMetadata | None = kwargs.get("cbgen_meta")
    if meta is None:
        raise _no_metadata_error()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    backend = meta.backend
    layer = module.layer_idx
    k_cache, v_cache = meta.kv_caches[layer]

    q = query[0].transpose(0, 1)  # [T, H, D]
    backend.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping)

    nd = meta.num_decode
    if not meta.prefills:
        out = backend.decode(meta, q, k_cache, v_cache, scale, sliding_window, softcap)
        return out[None], None

    out = torch.empty_like(q)
    if nd:
        out[:nd] = backend.decode(meta, q[:nd], k_cache, v_cache, scale, sliding_window, softcap)
    if meta.row_prefill_idx is not None:
        idx = meta.row_prefill_idx
        out[idx] = backend.decode_kernel(
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
    backend.prefill(meta, query, key, value, k_cache, v_cache, scale, sliding_window, softcap, out)
    return out[None], None


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
