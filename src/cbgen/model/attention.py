"""Paged attention, plugged into transformers through ``AttentionInterface``.

The batch metadata travels as a keyword argument of the model call (``cbgen_meta``), which
transformers forwards to every attention call.  Some decoder layers call their attention module
without forwarding their keyword arguments; for them the runner also publishes the step's metadata
in a context variable (:data:`CURRENT_META`) for the duration of the forward.  A context variable
rather than a field on the model or the cache: it is scoped to the thread and the step.  (The
implementation switch itself is per thread too, :mod:`cbgen.model.thread_view`: a plain forward or a
training step on the same module in another thread during a step never reaches this function.)  (transformers' own continuous batching reaches attention through the cache object
instead; cbgen passes no cache, since the model's KV handling would run on every layer for nothing.)

Packed layout of one step: ``T`` tokens in one row (batch dimension 1).  The first
``num_decode`` tokens are single-token rows (decodes, or a prompt's last token after a prefix-cache
hit); after them come prefill chunks, one contiguous run of query tokens per sequence.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import AttentionInterface

from cbgen.model.kernels.reference import paged_ops, varlen
from cbgen.model.kernels.reference import sinks as sinks_ref

ATTN_NAME = "cbgen_paged"

# The metadata of the step running in this thread, for layers that drop the ``cbgen_meta`` kwarg.
CURRENT_META: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "cbgen_step_metadata", default=None
)


@contextlib.contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Publishes ``meta`` as this thread's current step metadata for the duration of a forward."""
    token = CURRENT_META.set(meta)
    try:
        yield
    finally:
        CURRENT_META.reset(token)


class LayerAttention(NamedTuple):
    """One attention layer's parameters, as every backend takes them: the score scale, the sliding
    window (None: none), the logit soft cap (None: none) and the per-head sink logits (None: none;
    gpt-oss).  Made once per layer call from what the module passes."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


@dataclass
class PrefillSeq:
    """One prefill chunk, in host ints: query tokens ``[q_start, q_start + q_len)`` of the packed
    batch, whose sequence already has ``ctx_len`` tokens in the cache.  Row ``i`` of
    :attr:`VarlenPrefill.block_table` belongs to ``AttentionMetadata.prefills[i]``."""

    q_start: int
    q_len: int
    ctx_len: int
    as_rows: bool = False  # attended by the decode kernel, one row per query token (see below)


@dataclass
class VarlenPrefill:
    """The step's prefill chunks in varlen form, on the device, for kernels that attend them all in
    one call (the contract of :mod:`cbgen.model.kernels.reference.varlen`): chunk ``i`` owns rows
    ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1]`` of the packed prefill queries ``q[num_decode:]`` and
    attends to the first ``seq_lens_k[i]`` tokens (context plus itself) of its sequence through
    ``block_table[i]``.  Built once per step by the input builder, in one host-to-device copy."""

    cu_seqlens_q: torch.Tensor  # [N + 1] int32, from 0
    cu_seqlens_k: torch.Tensor  # [N + 1] int32: cumulative seq_lens_k (flash-attn takes these)
    seq_lens_k: torch.Tensor  # [N] int32
    block_table: torch.Tensor  # [N, W] int32, padded with block 0 (never read past a length)
    max_q_len: int
    max_k_len: int
    num_tokens: int  # query tokens of all chunks


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
    varlen: VarlenPrefill | None = None  # set when ``prefills`` is not empty
    # Short prefill chunks attended as decode rows: query token i of a chunk whose sequence already
    # has c cached tokens is a row with context length c + i + 1, so causality comes from the length
    # alone.  One kernel call then replaces a per-sequence SDPA call (its fixed cost dominates short
    # chunks).  Set by the input builder only when the backend asks for it (``row_prefill_max``);
    # those chunks come first among the prefills, so their rows are the packed batch's
    # ``[num_decode, num_decode + row_prefill_tokens)``.
    row_prefill_chunks: int = 0
    row_prefill_tokens: int = 0
    row_prefill_table: torch.Tensor | None = None  # [N, W] int32
    row_prefill_lens: torch.Tensor | None = None  # [N] int32
    row_prefill_max_len: int = 0
    # The engine's backend; the runner sets it before every forward (the builder does not know it).
    backend: AttentionBackend | None = None
    # Layers that read another layer's keys and values (Gemma 4's KV-shared layers): their
    # producer stored this step's keys and values already, so they attend without storing.  Set by
    # the runner with ``kv_caches``, from the cache layout.
    kv_readers: frozenset[int] = frozenset()
    # Tensors derived once per step and shared by every layer (masks, index plans).
    derived: dict = field(default_factory=dict)

    def decode_mask(self, length: int, sliding_window: int | None) -> torch.Tensor:
        """Decode visibility mask, built once per step and window size and shared by all layers."""
        key = ("decode_mask", length, sliding_window)
        mask = self.derived.get(key)
        if mask is None:
            mask = paged_ops.decode_mask(self.decode_seq_lens, length, sliding_window)
            self.derived[key] = mask
        return mask


class AttentionBackend:
    """How one device path attends over the paged cache; one object per engine, chosen at start.

    :func:`paged_attention_forward` calls it once per layer through ``meta.backend``.  The defaults
    are the torch reference of :mod:`cbgen.model.kernels.reference.paged_ops`; :mod:`cbgen.model.backends` holds one
    subclass per device path and :func:`cbgen.model.backends.backend_choice`.  It lives here, next to
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
    # Whether :meth:`attend_with_sinks` works here (the torch reference's); the plan picks such a
    # backend for models whose attention has sink logits.
    attends_sinks: bool = True
    # Whether its kernels take keys and values of different head sizes (latent attention's 192 / 128).
    # A layer whose sizes differ is attended by the torch reference where they do not.
    mixed_head_sizes: bool = True

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
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Attention ``[B, H, D]`` of the step's decode rows ``q [B, H, D]`` (their KV stored)."""
        keys = paged_ops.gather_kv(k_cache, meta.decode_block_table, meta.decode_max_len)
        values = paged_ops.gather_kv(v_cache, meta.decode_block_table, meta.decode_max_len)
        mask = meta.decode_mask(keys.shape[2], layer.sliding_window)
        keys, values = paged_ops.hide_masked(keys, values, mask)
        return paged_ops.attend(q[:, :, None, :], keys, values, mask, layer.scale, layer.softcap)[:, :, 0, :]

    def prefill(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """Attention of every prefill chunk of the step, into rows ``num_decode:`` of ``out [T, H, D]``
        (contiguous).

        ``q [T, H, D]`` is the packed batch's queries, ``k``/``v [T, Hkv, D]`` its fresh keys and
        values (already in the cache), any strides.  One call per layer for all chunks: each
        backend picks its own way in.  Here: the chunks the builder laid out as decode rows
        through ``decode_kernel`` in one call (:meth:`prefill_rows`), the others through SDPA
        (:meth:`prefill_sdpa`)."""
        if meta.row_prefill_tokens:
            self.prefill_rows(meta, q, k_cache, v_cache, layer, out)
        self.prefill_sdpa(meta, q, k, v, k_cache, v_cache, layer, out)

    def attend_with_sinks(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Attention ``[T, H, D]`` of the whole step for a layer with sink logits (``layer.sinks``):
        the torch reference (:mod:`cbgen.model.kernels.reference.sinks`).  The plan picks this
        backend for models with sinks (``ExecutionPlan.attention_why`` says so); a backend that
        cannot attend with sinks raises instead of computing without them."""
        if not self.attends_sinks:
            raise NotImplementedError(
                f"the model uses attention sinks, which the {self.name!r} attention backend does not implement"
                + (" (parity mode, batch_invariant=True)" if self.name == "parity" else "")
            )
        return sinks_ref.paged_sink_attention(
            meta, q, k_cache, v_cache, layer.scale, layer.sliding_window, layer.sinks
        )

    def prefill_rows(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """The chunks laid out as decode rows (``AttentionMetadata.row_prefill_*``), one
        ``decode_kernel`` call for all of them."""
        lo = meta.num_decode
        hi = lo + meta.row_prefill_tokens
        out[lo:hi] = self.decode_kernel(
            q[lo:hi],
            k_cache,
            v_cache,
            meta.row_prefill_table,
            meta.row_prefill_lens,
            layer.scale,
            sliding_window=layer.sliding_window,
            softcap=layer.softcap,
            max_seq_len=meta.row_prefill_max_len,
        )

    def prefill_sdpa(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """The chunks not laid out as rows, one SDPA call each (:func:`varlen.attend_loop`).  A
        single call for all of them, padded or block-diagonal, measured slower on the CPU (see
        :mod:`cbgen.model.kernels.reference.varlen`)."""
        first = meta.row_prefill_chunks
        if first < len(meta.prefills):
            table = meta.varlen.block_table[first:]
            varlen.attend_loop(meta.prefills[first:], q, k, v, k_cache, v_cache, table, *layer[:3], out)


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
    A batch of one-token rows ``[B, H, 1, D]`` (a state model's decode forward,
    :mod:`cbgen.model.state_pieces`) is attended as the packed ``[1, H, B, D]`` and returned as
    ``[B, 1, H, D]``.
    """
    if query.shape[0] != 1:
        if query.shape[2] != 1:
            raise ValueError(
                f"cbgen's paged attention takes one packed row or a batch of one-token rows, got {tuple(query.shape)}"
            )
        out, _ = paged_attention_forward(
            module,
            query.transpose(0, 2),
            key.transpose(0, 2),
            value.transpose(0, 2),
            attention_mask,
            scaling,
            dropout,
            sliding_window,
            softcap,
            **kwargs,
        )
        return out.transpose(0, 1), None
    meta: AttentionMetadata | None = kwargs.get("cbgen_meta")
    if meta is None:
        meta = CURRENT_META.get()
        if meta is None:
            raise _no_metadata_error(module)
    if attention_mask is not None:
        # cbgen registers no mask function, so transformers builds no mask: a mask here is one the
        # module computed itself (a content-dependent bias, as Doge's dynamic mask), which the
        # paged kernels would silently drop.
        raise NotImplementedError(
            f"{type(module).__name__} passes its own attention mask or bias to attention, which cbgen's "
            "paged kernels do not apply"
        )
    layer = LayerAttention(
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        sliding_window,
        softcap,
        kwargs.get("s_aux"),
    )
    backend = meta.backend
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        # An attention block shared by several layers (Zamba) is told its layer per call, and tells
        # the cache object (a state model's StepStates records it) just before attending.
        layer_idx = meta.derived.get("cache_layer")
        if layer_idx is None:
            raise NotImplementedError(
                f"{type(module).__name__} has no layer index of its own (an attention block shared by "
                "several layers, told its layer per call): cbgen's paged cache finds a layer's keys and "
                "values by it"
            )
    calls = meta.derived.get("attention_calls")
    if calls is not None:  # the start-up probe counts calls per layer (cbgen.model.support)
        calls.append(layer_idx)
    k_cache, v_cache = meta.kv_caches[layer_idx]

    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"{type(module).__name__} (layer {layer_idx}) makes keys of {tuple(k.shape[1:])} and "
            f"values of {tuple(v.shape[1:])} (KV heads, head size) per token, and its KV cache holds "
            f"{tuple(k_cache.shape[2:])} and {tuple(v_cache.shape[2:])}: the cache was sized for other "
            "shapes (read from the config under tensor parallelism, else from a forward at engine start)"
        )
    if k_cache.shape[-1] != v_cache.shape[-1] and not backend.mixed_head_sizes:
        backend = _REFERENCE
    if layer_idx not in meta.kv_readers:
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if layer.sinks is not None:
        return backend.attend_with_sinks(meta, q, k_cache, v_cache, layer)[None], None

    nd = meta.num_decode
    if not meta.prefills:
        return backend.decode(meta, q, k_cache, v_cache, layer)[None], None

    # Contiguous, whatever q's strides: prefill kernels write row ranges of it in place.  Values may
    # be narrower than queries (latent attention), and the output is as wide as the values.
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = backend.decode(meta, q[:nd], k_cache, v_cache, layer)
    backend.prefill(meta, q, k, v, k_cache, v_cache, layer, out)
    return out[None], None


# The torch reference, for layers a backend's kernels do not take (see ``mixed_head_sizes``).
_REFERENCE = AttentionBackend()


def _no_metadata_error(module: torch.nn.Module) -> RuntimeError:
    return RuntimeError(
        f"cbgen's paged attention was called by {type(module).__name__} outside a cbgen step: a step makes "
        "it the model's attention implementation on the engine's thread only, for its forward; a forward "
        "that reaches it without the step's metadata (a layer that calls the attention module outside the "
        "model's forward) cannot be attended"
    )


def attention_configs(model: torch.nn.Module) -> list:
    """Every config object an attention module of ``model`` reads its implementation from (what
    the runner and the parity context switch, per thread, around a forward)."""
    configs: dict[int, object] = {}
    root = getattr(model, "config", None)
    if root is not None:
        configs[id(root)] = root
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    return list(configs.values())


_registered = False


def register() -> str:
    """Registers the paged attention function with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, paged_attention_forward)
        _registered = True
    return ATTN_NAME
