"""The ``flash_attn`` backend: paged decode attention through flash-attn 2's ``flash_attn_with_kvcache``.

Same contract and cache layout as :mod:`cbgen.model.kernels.reference.paged_ops` (``[num_blocks, block_size,
num_kv_heads, head_dim]`` per layer), which is exactly flash-attn's paged layout, so the cache is
read in place through the block table.  Only the decode half is flash's:

* **KV store**: flash-attn has no stand-alone store, so :func:`store_kv_for` picks an existing one:
  the Triton kernel where Triton runs on the device, else the torch reference.
* **Prefill**: every chunk of a step in one ``flash_attn_varlen_func`` call per layer, reading the
  cache in place through its ``block_table`` argument (:func:`varlen_prefill_attention`), where the
  installed flash-attn takes one; else the backend falls back to the Triton varlen kernel.

flash-attn 2 facts this module relies on (``csrc/flash_attn/flash_api.cpp`` and
``flash_attn/flash_attn_interface.py``, checked for v2.6.0 - v2.8.3 and the main branch):

* q, k and v must be fp16 or bf16 (one dtype) on an sm80+ GPU; head_dim at most 256 (not a multiple
  of 8: flash pads a copy of the whole cache on every call, so that is refused here too).
* A paged cache needs ``page_block_size % 256 == 0`` (``TORCH_CHECK``, every 2.x release); see
  :data:`PAGE_BLOCK_MULTIPLE`.  ``block_table`` and ``cache_seqlens`` must be int32, the table
  with a unit inner stride and the lengths contiguous.
* ``softcap`` exists since 2.6.0 (hence :data:`MIN_VERSION`); flash computes
  ``softcap * tanh(scale * qk / softcap)``, the reference's formula.
* A row with ``cache_seqlens == 0`` has no key block to visit: the kernel exits early and writes
  zeros (and the split-K combine turns all ``-inf`` partial LSEs into zero weights), so padding rows
  come out as zeros, as the Triton kernel's do.  Only the first ``cdiv(seq_len, kBlockN)`` tiles
  are read, so block-table entries past a row's length are never dereferenced.
* ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...,
  block_table=)``: with a block table, ``k``/``v`` are the paged caches and ``cu_seqlens_k`` the
  cumulative key lengths (context plus chunk); causal masks align to the bottom right, so query
  ``j`` of a chunk of ``n`` sits at ``seq_len_k - n + j``, the contract of
  :mod:`cbgen.model.kernels.reference.varlen`; the decode window mapping (:func:`_window`) holds
  for each query at its own position.  Older releases lack the ``block_table`` parameter, so
  :func:`_probe` looks for it by name rather than by version.  ``varlen_fwd`` needs int32
  ``cu_seqlens`` and a block table with a unit inner stride, and applies the same page-size rule.
* Releases up to 2.8.3 do no host synchronisation in ``fwd_kvcache``, so decode steps can be
  captured in CUDA graphs.  The main branch after 2.8.3 (flash-attn PR #2711, reporting 2.8.4)
  added ``seqlens_k.max().item()`` for paged caches: a device-to-host copy that fails inside a
  capture.  :func:`graph_capturable` therefore only vouches for versions below 2.8.4.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from cbgen.model.kernels.arg_checks import check_decode
from cbgen.model.kernels.reference import paged_ops
from cbgen.model.kernels.reference.varlen import check_varlen

log = logging.getLogger("cbgen")

__all__ = [
    "HAS_FLASH_ATTN",
    "MIN_VERSION",
    "PAGE_BLOCK_MULTIPLE",
    "check_geometry",
    "cuda_graphs_ok",
    "graph_capturable",
    "paged_decode_attention",
    "store_kv",
    "store_kv_for",
    "unavailable_reason",
    "varlen_available",
    "varlen_prefill_attention",
]

# flash-attn 2 only pages KV in blocks that are a multiple of this many tokens.
PAGE_BLOCK_MULTIPLE = 256
# First release whose flash_attn_with_kvcache takes ``softcap``.
MIN_VERSION = (2, 6, 0)
# First version whose paged fwd_kvcache syncs with the host (``.item()``), breaking CUDA graphs.
_FIRST_SYNCING_VERSION = (2, 8, 4)
_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Flash:
    """What importing flash-attn gave: the function, its version, or why there is none."""

    fn: object | None
    version: str | None
    error: str | None
    varlen: object | None = None  # flash_attn_varlen_func, when it takes a block table


def _parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"2.8.3.post1+cu12torch2.7"`` -> ``(2, 8, 3)``; None when it does not parse."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging ships with transformers
        return None
    try:
        return Version(str(text)).release[:3] if text else None
    except InvalidVersion:
        return None


def _probe() -> _Flash:
    """Imports flash-attn, guarding against every way a wheel built for another torch can fail."""
    try:
        import flash_attn

        fn = flash_attn.flash_attn_with_kvcache
    except Exception as exc:  # ImportError, or an undefined-symbol / CUDA error from the extension
        return _Flash(None, None, f"{type(exc).__name__}: {exc}")
    version = getattr(flash_attn, "__version__", None)
    parsed = _parse_version(version)
    if parsed is None or parsed < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        return _Flash(None, version, f"flash-attn {version} is installed; cbgen needs >= {need}")
    return _Flash(fn, version, None, _paged_varlen(flash_attn))


def _paged_varlen(module: object) -> object | None:
    """``flash_attn_varlen_func`` if this flash-attn's takes a ``block_table``, else None."""
    fn = getattr(module, "flash_attn_varlen_func", None)
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):  # a compiled function without a readable signature
        return None
    return fn if "block_table" in params else None


_FLASH = _probe()
HAS_FLASH_ATTN: bool = _FLASH.fn is not None


def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def unavailable_reason(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str | None:
    """Why the flash backend cannot serve this engine, or None when it can.

    ``block_size``/``head_dim`` of None are not checked (the runner checks them again with the
    cache's real geometry, see :func:`check_geometry`).
    """
    if _FLASH.fn is None:
        return f"flash-attn is not usable here ({_FLASH.error or 'not installed'})"
    if torch.device(device).type != "cuda":
        return f"flash-attn needs a CUDA device, not {device}"
    if dtype not in _DTYPES:
        return f"flash-attn needs a float16 or bfloat16 model, not {dtype}"
    major, minor = _compute_capability(torch.device(device))
    if major < 8:
        return f"flash-attn needs an Ampere (sm80) or newer GPU; this one is sm{major}{minor}"
    return _geometry_reason(block_size, head_dim)


def _geometry_reason(block_size: int | None, head_dim: int | None) -> str | None:
    if block_size is not None and block_size % PAGE_BLOCK_MULTIPLE:
        return (
            f"flash-attn's paged KV cache needs block_size to be a multiple of {PAGE_BLOCK_MULTIPLE}; "
            f"the engine's is {block_size} (set block_size={PAGE_BLOCK_MULTIPLE} to use flash_attn)"
        )
    if head_dim is not None and (head_dim > _MAX_HEAD_DIM or head_dim % 8):
        return f"flash-attn needs head_dim <= {_MAX_HEAD_DIM} and a multiple of 8; the model's is {head_dim}"
    return None


def check_geometry(block_size: int, head_dim: int) -> None:
    """Raises ``ValueError`` when the KV cache's block size or head size does not suit flash-attn."""
    reason = _geometry_reason(block_size, head_dim)
    if reason is not None:
        raise ValueError(f"attention_backend='flash_attn': {reason}")


def graph_capturable() -> bool:
    """Whether the installed flash-attn's paged decode can be captured in a CUDA graph (no host
    sync).  True for releases before 2.8.4, see the module docstring."""
    parsed = _parse_version(_FLASH.version)
    return _FLASH.fn is not None and parsed is not None and parsed < _FIRST_SYNCING_VERSION


def cuda_graphs_ok(device: torch.device) -> bool:
    """Whether decode steps of the flash backend on ``device`` may be captured; logs why not.

    Needs a capturable flash-attn (:func:`graph_capturable`) and a store kernel without host syncs
    (Triton: the torch reference store filters padding slots on the host).
    """
    from cbgen.model.kernels.triton import ops as triton_ops

    if not graph_capturable():
        log.warning(
            "cbgen: flash-attn %s synchronises with the host in paged decode (flash-attn >= 2.8.4), "
            "which CUDA graphs cannot capture: decode steps run eagerly. Use attention_backend='triton' "
            "or flash-attn <= 2.8.3 to keep CUDA graphs.",
            _FLASH.version,
        )
        return False
    if not triton_ops.available(device):
        log.warning(
            "cbgen: the flash_attn backend stores KV with the torch reference when Triton is missing, "
            "which CUDA graphs cannot capture: decode steps run eagerly. Install triton to keep CUDA graphs."
        )
        return False
    return True


def _window(sliding_window: int | None) -> tuple[int, int]:
    """flash's ``window_size`` for cbgen's ``sliding_window``.

    The reference (:func:`cbgen.model.kernels.reference.paged_ops.decode_mask`) lets the newest token of a row of
    length ``n`` see key ``j`` when ``n - 1 - w < j <= n - 1``: the last ``w`` keys, itself
    included.  flash aligns the query to the bottom right (query ``i`` of ``seqlen_q`` sits at
    ``i + n - seqlen_q``, here ``n - 1``) and keeps keys in ``[n - 1 - left, n - 1 + right]``,
    so ``left = w - 1`` gives ``j >= n - w``, i.e. ``j > n - 1 - w``, and ``right = 0`` stops at
    the query (there are no keys past ``n - 1`` anyway).  This is also how transformers maps
    ``sliding_window`` onto flash (``window_size = (sliding_window - 1, ...)``).

    Without a window, ``(-1, -1)``: with one query per row ``causal=True`` is a no-op (flash itself
    drops it), and a right edge of -1 lets flash take its GQA fast path (query heads of a group
    packed as rows of one tile), which any window disables.
    """
    if sliding_window is None:
        return (-1, -1)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return (int(sliding_window) - 1, 0)


def _int32(t: torch.Tensor) -> torch.Tensor:
    # No-ops (same tensor back) for the engine's int32 contiguous buffers, so nothing is launched.
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t.contiguous()


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
    """Decode attention over the paged cache; same contract as
    :func:`cbgen.model.kernels.reference.paged_ops.paged_decode_attention`.

    ``query [B, H, D]`` attends to the first ``seq_lens[b]`` cached tokens of its row (the last
    ``sliding_window`` of them if given, scores soft-capped by ``softcap`` if given).  Rows with
    ``seq_lens == 0`` return zeros.  ``max_seq_len`` is only a bound: flash reads each row's length
    from ``seq_lens``, which must not exceed it (as the engine guarantees; the C kernels do the
    same).  No host syncs and no data-dependent shapes, so it can be captured in a CUDA graph
    (with flash-attn <= 2.8.3, see :func:`graph_capturable`).  Returns ``[B, H, D]`` in
    ``query.dtype``.
    """
    del max_seq_len
    check_decode(query, k_cache, v_cache, block_table, seq_lens, index_dtype=None)
    fn = _FLASH.fn
    if fn is None:
        raise RuntimeError(f"the flash_attn backend needs flash-attn >= 2.6: {_FLASH.error}")
    if query.shape[0] == 0:  # flash rejects an empty batch
        return torch.empty_like(query)
    out_dtype = query.dtype
    if query.dtype != k_cache.dtype:
        query = query.to(k_cache.dtype)
    kwargs = {}
    if softcap is not None:
        kwargs["softcap"] = float(softcap)  # 0.0 (the default) means off; omitted when unused
    out = fn(
        query.unsqueeze(1),  # [B, 1, H, D]: one query token per row
        k_cache,
        v_cache,
        cache_seqlens=_int32(seq_lens),
        block_table=_int32(block_table),
        softmax_scale=float(scale),
        causal=True,
        window_size=_window(sliding_window),
        **kwargs,
    )
    out = out.squeeze(1)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def store_kv_for(device: torch.device | str):
    """The KV-store function the flash backend uses on ``device``: the Triton kernel where Triton
    runs there, else the torch reference.  Both skip slots of -1."""
    from cbgen.model.kernels.triton import ops as triton_ops

    return triton_ops.triton_store_kv if triton_ops.available(device) else paged_ops.store_kv


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`cbgen.model.kernels.reference.paged_ops.store_kv`, through :func:`store_kv_for`."""
    store_kv_for(key.device)(key, value, k_cache, v_cache, slot_mapping)


def varlen_available() -> bool:
    """Whether the installed flash-attn attends paged varlen prefill (see :func:`_paged_varlen`)."""
    return _FLASH.varlen is not None


def varlen_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    max_q_len: int,
    max_k_len: int,
) -> torch.Tensor:
    """Every prefill chunk of a step in one ``flash_attn_varlen_func`` call over the paged cache; the
    contract of :func:`cbgen.model.kernels.reference.varlen.varlen_prefill_attention`, with the key
    lengths given as ``cu_seqlens_k`` (cumulative, ``[N + 1]`` int32) and the longest chunk and key
    run as host ints.  Returns ``[Tq, H, D]`` in ``query.dtype``."""
    fn = _FLASH.varlen
    if fn is None:
        raise RuntimeError(
            f"flash-attn {_FLASH.version or '(not installed)'} has no paged flash_attn_varlen_func"
        )
    check_varlen(query, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k[1:])
    if query.shape[0] == 0:
        return torch.empty_like(query)
    out_dtype = query.dtype
    if query.dtype != k_cache.dtype:
        query = query.to(k_cache.dtype)
    kwargs = {}
    if softcap is not None:
        kwargs["softcap"] = float(softcap)
    out = fn(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_q_len),
        int(max_k_len),
        softmax_scale=float(scale),
        causal=True,
        window_size=_window(sliding_window),  # with causal, flash pins the right edge to 0
        block_table=block_table,
        **kwargs,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)
