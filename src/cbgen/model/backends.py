"""One attention backend object per device path, chosen once at engine start.

* :class:`TorchBackend`: the torch reference (:mod:`cbgen.model.kernels.reference.paged_ops`), on any device.
* :class:`CpuBackend`: the C kernels of :mod:`cbgen.model.kernels.cpu.ops`; also the only backend whose
  short prefill chunks attend as decode rows, and the one the fused CPU forward
  (:mod:`cbgen.model.cpu_fast.fused_forward`) runs its attention through.
* :class:`TritonBackend`: the Triton kernels of :mod:`cbgen.model.kernels.triton.ops` (CUDA, or the
  interpreter on CPU).
* :class:`FlashAttnBackend`: flash-attn's paged decode (:mod:`cbgen.model.kernels.flash.ops`), with the
  Triton store where Triton runs.
* :class:`ParityBackend`: parity mode's batch-invariant attention (``batch_invariant=True``), the
  trainer side's blocked core on keys gathered from the cache; chosen by the plan, not by
  ``attention_backend``.

Each holds its KV store and decode kernels, its prefill path (one call per layer for every chunk of
a step: the torch SDPA strategies of :class:`cbgen.model.attention.AttentionBackend`, the C decode
kernel's rows for short chunks on the CPU, the Triton varlen kernel, flash-attn's varlen function),
its geometry checks and what fixed-shape decode and CUDA graphs it allows.  :func:`backend_choice`
resolves the ``attention_backend`` setting to a name (the plan calls it) and :func:`make_backend`
builds that backend.  The Triton and flash-attn modules are imported only when their
backend is considered: importing them probes (and may initialise) their packages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from cbgen.batch_invariant import paged as parity_paged
from cbgen.model.attention import AttentionBackend, AttentionMetadata, LayerAttention, VarlenPrefill
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.reference import paged_ops

__all__ = [
    "AttentionBackend",
    "CpuBackend",
    "FlashAttnBackend",
    "KernelBackend",
    "ParityBackend",
    "TorchBackend",
    "TritonBackend",
    "backend_choice",
    "make_backend",
]


class TorchBackend(AttentionBackend):
    """The torch reference path: gathers each row's KV and runs SDPA (see the base class)."""

    name = "torch"


class ParityBackend(AttentionBackend):
    """Parity mode's attention (``batch_invariant=True``): every row through the trainer side's
    computation, the parity attention kernel of :func:`cbgen.batch_invariant.native.parity_form`
    (straight from the paged cache) or its torch form (:mod:`cbgen.batch_invariant.paged`).  Decode
    rows and prefill chunks take the same path, so a token's attention does not depend on how its
    context was computed, cached or batched."""

    name = "parity"
    attends_sinks = False
    mixed_head_sizes = False  # the parity plan refuses such models (cbgen.model.plan)

    def __init__(self) -> None:
        super().__init__()
        self.store_kv = _parity_store

    def decode(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Each decode row, at position ``seq_len - 1``, over its sequence's cached keys."""
        return parity_paged.attend_decode(
            q,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            meta.decode_max_len,
            *layer[:3],
            meta.derived,
        )

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
        """Every prefill chunk, its queries at positions ``ctx_len ..``, over its cached keys."""
        chunks = [(c.q_start, c.q_len, c.ctx_len) for c in meta.prefills]
        table = meta.varlen.block_table
        parity_paged.attend_chunks(q, k_cache, v_cache, chunks, table, *layer[:3], out, meta.derived)


def _parity_store(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    # A store only copies, so which one runs changes no bit: the C store on the CPU (one call where
    # the reference store filters padding slots and runs two index copies), the reference elsewhere.
    if (
        k_cache.device.type == "cpu"
        and key.dtype == value.dtype == k_cache.dtype
        and slots.dtype == torch.int64
        and cpu_kernels.supports(key.dtype)
        and cpu_kernels.available()
    ):
        tokens = key.shape[0]
        cpu_kernels.store_direct(key.reshape(tokens, -1), value.reshape(tokens, -1), k_cache, v_cache, slots)
        return
    paged_ops.store_kv(key, value, k_cache, v_cache, slots)


class KernelBackend(AttentionBackend):
    """A backend with its own paged decode and KV-store kernels.

    Its stores skip rows whose slot is -1, so padding rows of fixed-shape decode steps use that
    slot, and its decode kernels read each row's length from ``seq_lens`` (those rows have 0).
    """

    paged_decode = True
    # The kernels take one head size for keys and values; latent attention's layers (192 / 128) are
    # attended by the torch reference (AttentionBackend.mixed_head_sizes).
    mixed_head_sizes = False

    def __init__(self, store_kv: Callable[..., None], decode_kernel: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.store_kv = store_kv
        self.decode_kernel = decode_kernel

    def fixed_shape(self) -> AttentionBackend:
        """Itself: its store needs no host sync to skip padding rows."""
        return self

    def pad_slot(self, scratch_slot: int) -> int:
        """-1: the store skips those rows."""
        return -1

    def decode(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """The step's decode rows through ``decode_kernel``."""
        return self.decode_kernel(
            q,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            layer.scale,
            sliding_window=layer.sliding_window,
            softcap=layer.softcap,
            max_seq_len=meta.decode_max_len,
        )


class CpuBackend(KernelBackend):
    """The C kernels (``csrc/cpu_paged.c``), through torch custom ops on the transformers path (so
    ``torch.compile`` sees opaque calls) and directly (a ctypes call costs a few microseconds, a
    custom op tens) on the fused path's projection views."""

    name = "cpu"
    # Prefill chunks up to this many tokens attend through the C decode kernel, all in one call, one
    # row per query token, instead of one SDPA call per chunk (~30 us of fixed cost each): on the
    # overhead workload's 8-64 token prompts that call count was most of a prefill step.  Measured
    # (benchmarks/prefill_varlen.py, AVX2 EPYC, 256 prompts of 16-48 tokens, 30 layers, fp32 / bf16):
    # rows 0.37 / 0.35 s a step, per-chunk SDPA 1.2 / 1.7 s, one padded SDPA call 2.5 / 1.7 s, one
    # block-diagonal call 43 / 85 s.  Longer chunks keep SDPA's matmuls (a 2,048-token chunk after
    # 4,096: flash SDPA 6.1 / 15.1 s, rows 9.4 / 15.0 s).  Only measured on these kernels, hence 0 on
    # the other backends.
    row_prefill_max = 64
    # Keys and values of different head sizes (latent attention) run the C kernel's portable loops;
    # its vector loops take one size for both (cpu_paged.c).
    mixed_head_sizes = True

    def __init__(self, decode_impl: int = cpu_kernels.IMPL_FAST) -> None:
        # decode_impl: which loops the decode kernel runs (the plan's measured choice, decode_loops.py).
        super().__init__(
            cpu_kernels.store_kv, functools.partial(cpu_kernels.paged_decode_attention, impl=decode_impl)
        )
        self.decode_impl = decode_impl
        # The fused path's kernels, without the custom-op layer (see cpu_kernels.store_direct and
        # decode_direct for what they accept).
        self.store_direct = cpu_kernels.store_direct
        self.decode_direct = functools.partial(cpu_kernels.decode_direct, impl=decode_impl)

    def prefill_rows(
        self,
        meta: AttentionMetadata,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """The short chunks' rows straight through the C kernel (no custom-op layer: prefill steps
        are never compiled), reading the query rows in place when their heads are contiguous (the
        fused path's views; transformers' usually) and writing into ``out``."""
        lo = meta.num_decode
        hi = lo + meta.row_prefill_tokens
        # No other way in for a dtype the C kernel does not take: the plan gives such models the
        # torch backend, and the kernel refuses a query and cache of different dtypes.
        rows = q[lo:hi]
        if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
            rows = rows.contiguous()
        self.decode_direct(
            rows,
            k_cache,
            v_cache,
            meta.row_prefill_table,
            meta.row_prefill_lens,
            layer.scale,
            int(layer.sliding_window or 0),
            float(layer.softcap or 0.0),
            out=out[lo:hi],
        )

    def attend_projections(
        self,
        meta: AttentionMetadata,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        head_dim: int,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """Attention ``[T, H, D]`` of a step with prefill chunks, for the fused path: same semantics as
        :func:`cbgen.model.attention.paged_attention_forward`, from the projections' outputs ``q
        [T, H * D]`` and ``k``/``v`` ``[T, Hkv * D]`` (views with strided rows).  ``window`` 0 = none.

        Its prefill is the common :meth:`prefill`, on ``[T, H, D]`` views of the same memory.  Only
        the store and the decode rows stay here: the transformers path reaches the C kernels through
        torch custom ops (the compiled decode path needs opaque calls), which take ``[T, Hkv, D]``
        heads-first inputs and copy these strided rows; the fused path calls the kernels directly
        on the views, without those copies or the op dispatch."""
        tokens = q.shape[0]
        k_cache, v_cache = meta.kv_caches[layer_idx]
        self.store_direct(k, v, k_cache, v_cache, meta.slot_mapping)
        q3 = q.view(tokens, -1, head_dim)
        out = torch.empty(q3.shape, dtype=q.dtype)
        nd = meta.num_decode
        if nd:
            self.decode_direct(
                q3[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_seq_lens,
                scale,
                window,
                0.0,
                out=out[:nd],
            )
        k3, v3 = k.view(tokens, -1, head_dim), v.view(tokens, -1, head_dim)
        self.prefill(meta, q3, k3, v3, k_cache, v_cache, LayerAttention(scale, window or None), out)
        return out


class TritonBackend(KernelBackend):
    """The Triton kernels: CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""

    name = "triton"

    def __init__(self) -> None:
        from cbgen.model.kernels.triton import ops as triton_ops

        super().__init__(triton_ops.triton_store_kv, triton_ops.triton_paged_decode_attention)

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
        """Every chunk in one Triton varlen kernel launch, straight into ``out``."""
        _varlen_into(_triton_varlen, meta, q, k_cache, v_cache, layer, out)


class FlashAttnBackend(KernelBackend):
    """flash-attn 2's paged decode; KV stored by the Triton kernel where Triton runs on ``device``,
    else by the torch reference (which then rules out CUDA graphs, see :meth:`cuda_graphs_ok`)."""

    name = "flash_attn"

    def __init__(self, device: torch.device) -> None:
        from cbgen.model.kernels.flash import ops as flash_ops
        from cbgen.model.kernels.triton import ops as triton_ops

        super().__init__(flash_ops.store_kv_for(device), flash_ops.paged_decode_attention)
        # Prefill: flash-attn's paged varlen function, else the Triton varlen kernel, else the
        # torch strategies of the base class.
        self.varlen_kernel = None
        if flash_ops.varlen_available():
            self.varlen_kernel = _flash_varlen
        elif triton_ops.available(device):
            self.varlen_kernel = _triton_varlen

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
        """Every chunk in one varlen call (see ``varlen_kernel``)."""
        if self.varlen_kernel is None:
            super().prefill(meta, q, k, v, k_cache, v_cache, layer, out)
            return
        _varlen_into(self.varlen_kernel, meta, q, k_cache, v_cache, layer, out)

    def check_geometry(self, block_size: int, head_dim: int) -> None:
        """flash-attn's paged cache needs ``block_size`` a multiple of 256, and ``head_dim`` at most
        256 and a multiple of 8."""
        from cbgen.model.kernels.flash import ops as flash_ops

        flash_ops.check_geometry(block_size, head_dim)

    def cuda_graphs_ok(self, device: torch.device) -> bool:
        """False (logged) for flash-attn versions that sync with the host in paged decode, and
        without Triton (the reference store syncs)."""
        from cbgen.model.kernels.flash import ops as flash_ops

        return flash_ops.cuda_graphs_ok(device)


def _varlen_into(
    kernel: Callable[..., None],
    meta: AttentionMetadata,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: LayerAttention,
    out: torch.Tensor,
) -> None:
    """All prefill chunks through one varlen ``kernel`` call (``_triton_varlen``'s signature, the
    contract of :mod:`cbgen.model.kernels.reference.varlen`), into ``out[num_decode:]``."""
    if meta.row_prefill_tokens:
        raise ValueError("a varlen prefill kernel got chunks laid out as decode rows (row_prefill_max > 0)")
    nd = meta.num_decode
    kernel(q[nd:], k_cache, v_cache, meta.varlen, layer, out[nd:])


def _triton_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    info: VarlenPrefill,
    layer: LayerAttention,
    out: torch.Tensor,
) -> None:
    from cbgen.model.kernels.triton import prefill as triton_prefill

    triton_prefill.triton_varlen_prefill_attention(
        query,
        k_cache,
        v_cache,
        info.block_table,
        info.cu_seqlens_q,
        info.seq_lens_k,
        *layer[:3],
        max_q_len=info.max_q_len,
        out=out,
    )


def _flash_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    info: VarlenPrefill,
    layer: LayerAttention,
    out: torch.Tensor,
) -> None:
    from cbgen.model.kernels.flash import ops as flash_ops

    out.copy_(
        flash_ops.varlen_prefill_attention(
            query,
            k_cache,
            v_cache,
            info.block_table,
            info.cu_seqlens_q,
            info.cu_seqlens_k,
            *layer[:3],
            max_q_len=info.max_q_len,
            max_k_len=info.max_k_len,
        )
    )


def backend_choice(
    requested: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> tuple[str, str]:
    """The backend name for the ``attention_backend`` setting ``requested``, and why.

    ``auto`` picks, on CUDA, ``flash_attn`` when flash-attn is installed and suits the engine (fp16/bf16,
    sm80+, ``block_size`` a multiple of 256, ``head_dim`` <= 256, a version whose decode CUDA graphs
    capture), else ``triton`` when Triton is installed; on CPU ``cpu`` (the C kernels of
    :mod:`cbgen.model.kernels.cpu.ops`) when they build here and handle ``dtype``; else ``torch``.
    ``auto`` only considers flash-attn when ``block_size`` and ``head_dim`` are given.  An explicit
    request that cannot work raises ``ValueError`` with the reason (for ``flash_attn``, sizes not
    given are checked again by the runner against the KV cache, :meth:`AttentionBackend.check_geometry`).
    """
    flash_note = ""
    if requested == "auto" and device.type == "cuda" and block_size is not None and head_dim is not None:
        from cbgen.model.kernels.flash import ops as flash_ops

        if flash_ops.HAS_FLASH_ATTN:
            reason = flash_ops.unavailable_reason(device, dtype, block_size, head_dim)
            if reason is None and not flash_ops.graph_capturable():
                reason = "this flash-attn version cannot be captured in CUDA graphs (>= 2.8.4)"
            if reason is None:
                return "flash_attn", "auto on CUDA: flash-attn is installed and suits this model and cache"
            flash_ops.log.info("cbgen: flash-attn installed but not used: %s", reason)
            flash_note = f"; flash-attn not used: {reason}"
    if requested == "flash_attn":
        from cbgen.model.kernels.flash import ops as flash_ops

        reason = flash_ops.unavailable_reason(device, dtype, block_size, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend='flash_attn' cannot be used: {reason}")
        return "flash_attn", "requested"
    if requested in ("auto", "triton"):
        from cbgen.model.kernels.triton import ops as triton_ops

        if triton_ops.HAS_TRITON and (
            device.type == "cuda" or (requested == "triton" and triton_ops.available(device))
        ):
            return "triton", "requested" if requested == "triton" else f"auto on CUDA: Triton{flash_note}"
        if requested == "triton":
            raise ValueError(
                "attention_backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1)"
            )
    # Short-circuits in this order: only a request that may use the C kernels builds them.
    if (
        requested in ("auto", "cpu")
        and device.type == "cpu"
        and cpu_kernels.supports(dtype)
        and cpu_kernels.available()
    ):
        name = str(dtype).removeprefix("torch.")
        return "cpu", "requested" if requested == "cpu" else f"auto on the CPU: the C kernels, {name}"
    if requested == "cpu":
        raise ValueError(
            f"attention_backend='cpu' needs a CPU device, a float32/bfloat16 model and a C compiler "
            f"(device {device}, dtype {dtype}; {_cpu_reason()})"
        )
    return "torch", _torch_reason(requested, device, dtype) + flash_note


def _torch_reason(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Why ``auto`` (or a request) ends at the torch reference."""
    if requested == "torch":
        return "requested"
    if device.type == "cuda":
        return "auto on CUDA without Triton: the reference path"
    if device.type != "cpu":
        return f"auto on {device.type}: the reference path"
    if not cpu_kernels.supports(dtype):
        return (
            f"auto on the CPU: the C kernels take float32/bfloat16, not {str(dtype).removeprefix('torch.')}"
        )
    return f"auto on the CPU: the C kernels are unavailable ({_cpu_reason()})"


def make_backend(
    name: str, device: torch.device, decode_impl: int = cpu_kernels.IMPL_FAST
) -> AttentionBackend:
    """A new backend object of the name :func:`backend_choice` returned (``decode_impl``: the C
    backend's decode loops)."""
    if name == "cpu":
        return CpuBackend(decode_impl)
    if name == "triton":
        return TritonBackend()
    if name == "flash_attn":
        return FlashAttnBackend(device)
    if name == "torch":
        return TorchBackend()
    if name == "parity":
        return ParityBackend()
    raise ValueError(f"unknown attention backend {name!r}")


def _cpu_reason() -> str:
    return cpu_kernels.unavailable_reason() or "kernels not built"
