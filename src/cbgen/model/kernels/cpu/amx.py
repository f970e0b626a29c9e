"""The bf16 AMX projections (``csrc/cpu_gemm.c``), wrapped for :mod:`cbgen.model.cpu_fast.fused_forward`.

They live in the same library as the paged-attention kernels (:mod:`cbgen.model.kernels.cpu.ops`
builds and loads it); this module only adds their Python entry points, each of which checks its
arguments before calling into C.
"""

from __future__ import annotations

import torch

from cbgen import envs
from cbgen.model.kernels.arg_checks import check_rows
from cbgen.model.kernels.cpu.ops import available, library
from cbgen.utils import advise_huge_pages

_amx: bool | None = None


def amx_available() -> bool:
    """Whether the bf16 AMX projections of ``csrc/cpu_gemm.c`` run here: the kernels are built for a
    CPU with AMX-BF16 and the OS granted this process the tile state."""
    global _amx
    if _amx is None:
        _amx = available() and envs.get("CBGEN_AMX") != "0" and library().cbgen_amx_init() == 1
    return _amx


def amx_supports(weight: torch.Tensor) -> bool:
    """Whether :func:`amx_pack` takes ``weight`` (bf16 ``[N, K]`` with N and K multiples of 32)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.shape[0] % 32
        and not weight.shape[1] % 32
    )


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` rearranged into the tile layout :func:`amx_linear` streams (a copy, on huge
    pages where granted; see ``csrc/cpu_gemm.c``)."""
    n, k = weight.shape
    tiles = weight.detach().view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return advise_huge_pages(torch.empty(tiles.shape, dtype=weight.dtype)).copy_(tiles)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``packed = amx_pack(weight)``; ``x [M, K]`` bf16 with unit
    column stride, ``bias`` bf16 or None."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = packed.shape[0] * 32
    if (
        packed.dim() != 6
        or packed.dtype != torch.bfloat16
        or packed.shape[1] * 32 != k
        or not packed.is_contiguous()
    ):
        raise ValueError(f"amx_linear: packed weight {tuple(packed.shape)} does not take inputs of width {k}")
    check_rows("x", x, rows, k, torch.bfloat16)
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError(
            f"amx_linear: bias must be a contiguous bf16 [{n}], got {tuple(bias.shape)} {bias.dtype}"
        )
    out = torch.empty((rows, n), dtype=x.dtype)
    rc = library().cbgen_amx_linear(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
    )
    if rc:
        raise RuntimeError(
            f"cbgen_amx_linear failed with code {rc} for x {tuple(x.shape)}, weight [{n}, {k}]"
        )
    return out
