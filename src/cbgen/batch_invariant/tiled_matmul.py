"""Matrix products whose every output row is reduced over K in one order, whatever the row count.

Where :func:`cbgen.batch_invariant.native.parity_form` says so, a parity kernel computes them: on the
CPU :func:`cbgen.batch_invariant.kernels.cpu_parity.parity_linear` (each element one fixed chain over K,
whatever the row count; the engine passes its packed weights, :mod:`cbgen.batch_invariant.packs`), on
CUDA the Triton one.  Elsewhere torch's GEMM is made to behave: a BLAS picks its kernel, its blocking
and sometimes a split of K by the shape of the call, so a row's result depends on how many rows share
the call.  Here the rows are cut into tiles of :data:`TILE`
rows (the last one padded with zeros) and each tile is one call of the same shape: the same kernel,
so each row's reduction order depends on K and N only.  Smaller tiles waste less on decode steps,
larger ones make fewer calls on prefill steps; 32 was picked from 16 / 32 / 64 by a (noisy)
measurement, see docs/rl.md, "Trainer parity".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cbgen.batch_invariant.kernels.cpu_parity import parity_linear
from cbgen.batch_invariant.kernels.triton_parity import triton_parity_linear
from cbgen.batch_invariant.native import parity_form
from cbgen.batch_invariant.packs import WeightPacks

TILE = 32
# Allocations are 64-byte aligned; a tile of 32 rows starts on that boundary for any K in fp32/bf16.
_ALIGN = 64

MM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tiled_mm(mm: MM, a: torch.Tensor, b: torch.Tensor, packs: WeightPacks | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]``: the C parity GEMM (from ``packs``' copy of ``b`` where it holds one),
    or through ``mm`` :data:`TILE` rows at a time (see the module docstring)."""
    tile = TILE
    rows, inner = a.shape
    if inner <= 1 or rows == 0:
        # One product per output (exact whatever the kernel), or nothing to compute.
        return mm(a, b)
    form = parity_form(a.device, a.dtype) if a.dtype == b.dtype and a.device == b.device else "torch"
    if form != "torch":
        # b is usually a Linear weight's transposed view: its rows are the weight's rows, no copy.
        weight = b.t() if b.t().stride(-1) == 1 else b.t().contiguous()
        x = a if a.stride(-1) == 1 else a.contiguous()
        if form == "triton":
            return triton_parity_linear(x, weight)
        return parity_linear(x, weight, packs.get(weight) if packs is not None else None)
    if not a.is_contiguous() or a.data_ptr() % _ALIGN:
        # Every tile the kernel sees: contiguous, 64-byte aligned (tile offsets keep that).
        a = a.clone(memory_format=torch.contiguous_format)
    full = rows - rows % tile
    parts = [mm(a[i : i + tile], b) for i in range(0, full, tile)]
    if full < rows:
        last = a.new_zeros(tile, inner)  # padded with zero rows, which change no other row
        last[: rows - full] = a[full:]
        parts.append(mm(last, b)[: rows - full])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tiled_bmm(mm: MM, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``, each batch entry through :func:`tiled_mm`."""
    if a.shape[2] <= 1:
        return torch.bmm(a, b)
    if a.shape[0] == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    return torch.stack([tiled_mm(mm, a[i], b[i]) for i in range(a.shape[0])])


def tiled_grouped_mm(mm: MM, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``torch._grouped_mm`` of ``a [S, K]`` (rows sorted by group) and ``b [G, K, N]`` with the end
    offsets ``offs [G]``: group ``g``'s rows times ``b[g]``, each through :func:`tiled_mm`."""
    if offs is None or a.dim() != 2 or b.dim() != 3:
        raise NotImplementedError("parity mode handles torch._grouped_mm of 2-D inputs with offsets only")
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = tiled_mm(mm, a[start:end], b[g])
        start = end
    return out
