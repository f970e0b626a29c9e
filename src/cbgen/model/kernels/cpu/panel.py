"""The panel GEMMs of ``csrc/cpu_panel.c`` (AVX2 + FMA) and ``csrc/cpu_panel512.c`` (AVX512-BF16),
wrapped for the measured GEMM choice.

A weight is packed once into panels of 16 output columns (float32, or bfloat16 for a bfloat16
weight) (:func:`panel_pack`), and :func:`panel_linear` computes ``F.linear(x, weight, bias)`` from
them for any row count.  On AVX-512 CPUs a weight can instead be packed into panels of 32 columns
(:func:`panel512_pack`, bfloat16 by k pairs) for :func:`panel512_linear`, whose bfloat16 form feeds
bf16 straight into vdpbf16ps.  Each is a
candidate of :mod:`cbgen.model.cpu_fast.gemm_choice`: it runs only where it was timed faster than the
library GEMMs on this machine.  Every entry point checks its arguments before calling into C.
"""

from __future__ import annotations

import torch

from cbgen.model.kernels.arg_checks import check_rows
from cbgen.model.kernels.cpu.ops import available, library
from cbgen.utils import advise_huge_pages

PANEL = 16  # output columns per panel (two 8-lane vectors)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_RC = {1: "rejected its sizes", 2: "was built without AVX2 + FMA", 3: "could not allocate its scratch"}


def panel_available() -> bool:
    """Whether the panel GEMM runs here: the kernels built, for a CPU with AVX2 and FMA."""
    if not available():
        return False
    try:
        probe = torch.ones(1, 1)
        return panel_linear(probe, panel_pack(probe), 1).item() == 1.0
    except RuntimeError:  # built without AVX2 + FMA
        return False


def _dtype(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES:
        raise ValueError(f"the panel GEMM takes float32 or bfloat16, got {t.dtype}")
    return _DTYPES[t.dtype]


def panel_pack(weight: torch.Tensor, panel_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [N, K]`` (float32 or bfloat16, contiguous rows) as panels ``[ceil(N / 16), K, 16]``
    of ``panel_dtype`` (float32; bfloat16 only for a bfloat16 weight), the columns past N zero (a
    copy, on huge pages where granted)."""
    if weight.dim() != 2:
        raise ValueError(f"panel_pack: expected a 2-D weight, got {tuple(weight.shape)}")
    n, k = weight.shape
    check_rows("weight", weight, n, k, weight.dtype)
    dtype = _dtype(weight)
    if panel_dtype not in _DTYPES or _DTYPES[panel_dtype] > dtype:
        raise ValueError(f"panel_pack: {weight.dtype} weights pack into float32 panels, not {panel_dtype}")
    packed = advise_huge_pages(torch.empty(((n + PANEL - 1) // PANEL, k, PANEL), dtype=panel_dtype))
    rc = library().cbgen_panel_pack(
        weight.data_ptr(),
        weight.stride(0),
        n,
        k,
        dtype,
        packed.data_ptr(),
        packed.numel(),
        _DTYPES[panel_dtype],
    )
    if rc:
        raise ValueError(f"cbgen_panel_pack {_RC.get(rc, rc)} (weight [{n}, {k}])")
    return packed


def panel_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``packed = panel_pack(weight)`` (``weight`` had ``n`` rows):
    ``x [M, K]`` float32 or bfloat16 with contiguous rows, ``bias [n]`` of x's dtype or None; the
    output has x's dtype, accumulated in float32.  The panels are checked against ``n`` and K, so
    the kernel never reads past them; they cannot tell ``n`` from another width that rounds up to
    the same panels (the extra columns would read the zero padding)."""
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"panel_linear: expected x [M >= 1, K], got {tuple(x.shape)}")
    rows, k = x.shape
    dtype = _dtype(x)
    if (
        packed.dim() != 3
        or packed.dtype not in (torch.float32, x.dtype)
        or packed.shape != ((n + PANEL - 1) // PANEL, k, PANEL)
        or not packed.is_contiguous()
    ):
        raise ValueError(f"panel_linear: packed {tuple(packed.shape)} is not a [{n}, {k}] weight's panels")
    check_rows("x", x, rows, k, x.dtype)
    if bias is not None:
        check_rows("bias", bias.view(1, -1), 1, n, x.dtype)
    out = torch.empty((rows, n), dtype=x.dtype)
    rc = library().cbgen_panel_gemm(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        packed.numel(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
        dtype,
        _DTYPES[packed.dtype],
    )
    if rc:
        raise RuntimeError(f"cbgen_panel_gemm {_RC.get(rc, rc)} (x {tuple(x.shape)}, weight [{n}, {k}])")
    return out


# The AVX-512 panel GEMMs (csrc/cpu_panel512.c): panels of 32 columns, float32 by k, bfloat16 by k
# pairs (vdpbf16ps).
PANEL512 = 32


def panel512_available(dtype: torch.dtype) -> bool:
    """Whether the AVX-512 panel GEMM for ``dtype`` runs here: the kernels built for a CPU with
    AVX-512 (float32) or AVX512-BF16 (bfloat16)."""
    if dtype not in _DTYPES or not available():
        return False
    return bool(int(library().cbgen_p512_built()) & (1 << _DTYPES[dtype]))


def panel512_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The packed shape of an ``[n, k]`` weight: float32 ``[ceil(n / 32), k, 32]``, bfloat16
    ``[ceil(n / 32), ceil(k / 2), 32, 2]``."""
    panels = -(-n // PANEL512)
    return (panels, k, PANEL512) if dtype == torch.float32 else (panels, -(-k // 2), PANEL512, 2)


def panel512_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 ``weight [N, K]`` (contiguous rows) as :func:`panel512_linear`'s panels,
    in its own dtype (a copy, on huge pages where granted; columns past N and the slot past an odd K
    are zero)."""
    if weight.dim() != 2:
        raise ValueError(f"panel512_pack: expected a 2-D weight, got {tuple(weight.shape)}")
    n, k = weight.shape
    _dtype(weight)
    check_rows("weight", weight, n, k, weight.dtype)
    packed = advise_huge_pages(torch.empty(panel512_shape(n, k, weight.dtype), dtype=weight.dtype))
    pack = library().cbgen_p512_pack if weight.dtype == torch.float32 else library().cbgen_dp_pack
    if pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr(), packed.numel()):
        raise ValueError(f"panel512_pack rejected its sizes (weight [{n}, {k}])")
    return packed


def panel512_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``packed = panel512_pack(weight)`` (``weight`` had ``n``
    rows, of x's dtype): ``x [M >= 1, K]`` float32 or bfloat16 with contiguous rows.  Sums in float32
    (bfloat16: exact products of pairs, through vdpbf16ps), the output in x's dtype, rounded once
    after the bias.  Each output element is one chain over k in order, whatever M, the tile or the
    thread.  ``out``: a ``[M, n]`` tensor with contiguous rows to write into (default: a new one).
    Raises RuntimeError where :func:`panel512_available` is False."""
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"panel512_linear: expected x [M >= 1, K], got {tuple(x.shape)}")
    rows, k = x.shape
    _dtype(x)
    if packed.dtype != x.dtype or packed.shape != panel512_shape(n, k, x.dtype) or not packed.is_contiguous():
        raise ValueError(
            f"panel512_linear: packed {tuple(packed.shape)} is not a [{n}, {k}] {x.dtype} weight's panels"
        )
    check_rows("x", x, rows, k, x.dtype)
    if bias is not None:
        check_rows("bias", bias.view(1, -1), 1, n, x.dtype)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype)
    else:
        check_rows("out", out, rows, n, x.dtype)
    gemm = library().cbgen_p512_gemm if x.dtype == torch.float32 else library().cbgen_dp_gemm
    rc = gemm(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        packed.numel(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        n,
        k,
    )
    if rc:
        why = "was built without AVX-512 for this dtype" if rc == 2 else "rejected its sizes"
        raise RuntimeError(f"the AVX-512 panel GEMM {why} (x {tuple(x.shape)}, weight [{n}, {k}])")
    return out


__all__ = [
    "PANEL",
    "PANEL512",
    "panel512_available",
    "panel512_linear",
    "panel512_pack",
    "panel512_shape",
    "panel_available",
    "panel_linear",
    "panel_pack",
]
