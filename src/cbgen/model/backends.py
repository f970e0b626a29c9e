"""One attention backend object per device path, chosen once at engine start.

* :class:`TorchBackend`: the torch reference (:mod:`cbgen.model.kernels.reference.paged_ops`), on any device.
* :class:`CpuBackend`: the C kernels of :mod:`cbgen.model.kernels.cpu.ops`; also the only backend whose
  short prefill chunks attend as decode rows, and the one the fused CPU forward
  (:mod:`cbgen.model.cpu_fast.fused_forward`) runs its attention through.
* :class:`TritonBackend`: the Triton kernels of :mod:`cbgen.model.kernels.triton.ops` (CUDA, or the
  interpreter on CPU).
* :class:`FlashAttnBackend`: flash-attn's paged decode (:mod:`cbgen.model.kernels.flash.ops`), with the
  Triton store where Triton runs.

Each holds its KV store and decode kernels, its prefill path (the shared per-chunk SDPA of
:class:`cbgen.model.attention.AttentionBackend` for all of them today), its geometry checks and what
fixed-shape decode and CUDA graphs it allows.  :func:`select_backend` resolves the
``attention_backend`` setting.  The Triton and flash-attn modules are imported only when their
backend is considered: importing them probes (and may initialise) their packages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cbgen.model.attention import AttentionBackend, AttentionMetadata
from cbgen.model.kernels.cpu import ops as cpu_kernels

__all__ = [
    "AttentionBackend",
    "CpuBackend",
    "FlashAttnBackend",
    "KernelBackend",
    "TorchBackend",
    "TritonBackend",
    "choose_backend",
    "select_backend",
]


class TorchBackend(AttentionBackend):
    """The torch reference path: gathers each row's KV and runs SDPA (see the base class)."""

    name = "torch"


class KernelBackend(AttentionBackend):
    """A backend with its own paged decode and KV-store kernels.

    Its stores skip rows whose slot is -1, so padding rows of fixed-shape decode steps use that
    slot, and its decode kernels read each row's length from ``seq_lens`` (those rows have 0).
    """

    paged_decode = True

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
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The step's decode rows through ``decode_kernel``."""
        return self.decode_kernel(
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


class CpuBackend(KernelBackend):
    """The C kernels (``csrc/cpu_paged.c``), through torch custom ops on the transformers path (so
    ``torch.compile`` sees opaque calls) and directly (a ctypes call costs a few microseconds, a
    custom op tens) on the fused path's projection views."""

    name = "cpu"
    # Prefill chunks up to this many tokens attend through the C decode kernel, one row per query
    # token, instead of one SDPA call per chunk (~30 us of fixed cost each): on the overhead
    # workload's 8-64 token prompts that call count was most of a prefill step.  Longer chunks keep
    # SDPA's matmuls.  Only measured on these kernels, hence 0 on the other backends.
    row_prefill_max = 64

    def __init__(self) -> None:
        super().__init__(cpu_kernels.store_kv, cpu_kernels.paged_decode_attention)
        # The fused path's kernels, without the custom-op layer (see cpu_kernels.store_direct and
        # decode_direct for what they accept).
        self.store_direct = cpu_kernels.store_direct
        self.decode_direct = cpu_kernels.decode_direct

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
        [T, H * D]`` and ``k``/``v`` ``[T, Hkv * D]`` (views with strided rows: no transposed
        copies).  The KV store, decode rows and short chunks go straight to the C kernels, longer
        chunks through :meth:`prefill`.  ``window`` 0 = none."""
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
        if meta.row_prefill_idx is not None:
            idx = meta.row_prefill_idx
            out[idx] = self.decode_direct(
                q3.index_select(0, idx),
                k_cache,
                v_cache,
                meta.row_prefill_table,
                meta.row_prefill_lens,
                scale,
                window,
                0.0,
            )

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.view(tokens, -1, head_dim).transpose(0, 1)[None]

        self.prefill(
            meta,
            heads_first(q),
            heads_first(k),
            heads_first(v),
            k_cache,
            v_cache,
            scale,
            window or None,
            None,
            out,
        )
        return out


class TritonBackend(KernelBackend):
    """The Triton kernels: CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""

    name = "triton"

    def __init__(self) -> None:
        from cbgen.model.kernels.triton import ops as triton_ops

        super().__init__(triton_ops.triton_store_kv, triton_ops.triton_paged_decode_attention)


class FlashAttnBackend(KernelBackend):
    """flash-attn 2's paged decode; KV stored by the Triton kernel where Triton runs on ``device``,
    else by the torch reference (which then rules out CUDA graphs, see :meth:`cuda_graphs_ok`)."""

    name = "flash_attn"

    def __init__(self, device: torch.device) -> None:
        from cbgen.model.kernels.flash import ops as flash_ops

        super().__init__(flash_ops.store_kv_for(device), flash_ops.paged_decode_attention)

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


def select_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend for the ``attention_backend`` setting ``requested``.

    ``auto`` picks, on CUDA, ``flash_attn`` when flash-attn is installed and suits the engine (fp16/bf16,
    sm80+, ``block_size`` a multiple of 256, ``head_dim`` <= 256, a version whose decode CUDA graphs
    capture), else ``triton`` when Triton is installed; on CPU ``cpu`` (the C kernels of
    :mod:`cbgen.model.kernels.cpu.ops`) when they build here and handle ``dtype``; else ``torch``.
    ``auto`` only considers flash-attn when ``block_size`` and ``head_dim`` are given.  An explicit
    ``flash_attn`` that cannot work raises ``ValueError`` with the reason (unknown sizes are checked
    again by the runner against the KV cache, :meth:`AttentionBackend.check_geometry`).
    """
    if requested == "auto" and device.type == "cuda" and block_size is not None and head_dim is not None:
        from cbgen.model.kernels.flash import ops as flash_ops

        if flash_ops.HAS_FLASH_ATTN:
            reason = flash_ops.unavailable_reason(device, dtype, block_size, head_dim)
            if reason is None and not flash_ops.graph_capturable():
                reason = "this flash-attn version cannot be captured in CUDA graphs (>= 2.8.4)"
            if reason is None:
                return FlashAttnBackend(device)
            flash_ops.log.info("cbgen: flash-attn installed but not used: %s", reason)
    if requested == "flash_attn":
        from cbgen.model.kernels.flash import ops as flash_ops

        reason = flash_ops.unavailable_reason(device, dtype, block_size, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend='flash_attn' cannot be used: {reason}")
        return FlashAttnBackend(device)
    if requested in ("auto", "triton"):
        from cbgen.model.kernels.triton import ops as triton_ops

        if triton_ops.HAS_TRITON and (
            device.type == "cuda" or (requested == "triton" and triton_ops.available(device))
        ):
            return TritonBackend()
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
        return CpuBackend()
    if requested == "cpu":
        raise ValueError(
            f"attention_backend='cpu' needs a CPU device, a float32/bfloat16 model and a C compiler "
            f"(device {device}, dtype {dtype}; {_cpu_reason()})"
        )
    return TorchBackend()


def choose_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str:
    """The name of the backend :func:`select_backend` picks (same arguments, same errors)."""
    return select_backend(requested, device, dtype, block_size=block_size, head_dim=head_dim).name


def _cpu_reason() -> str:
    return cpu_kernels.unavailable_reason() or "kernels not built"
