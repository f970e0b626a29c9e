"""Parity mode's exact elementwise steps (``csrc/cpu_parity_rows.c``): one C call each where the
module forward runs a chain of torch's elementwise ops, with the same bits (see the C file).  The
direct forward (:mod:`cbgen.batch_invariant.direct_forward`) calls them: the plan runs it only where
the C parity kernels are built.  The torch chains they replace are their reference in the tests.

Each wrapper checks shapes, dtypes and strides before the C side sees a pointer.  The C file is in
``cbgen/model/kernels/cpu/csrc/``, built with the other C kernels by :mod:`cbgen.model.kernels.cpu.ops`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from pathlib import Path

import torch

from cbgen.model.kernels.arg_checks import check_rows
from cbgen.model.kernels.cpu.ops import library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _stride(t: torch.Tensor) -> int:
    # The row stride of a tensor of at most one row is arbitrary in torch; the C side wants at least
    # a row's length.
    return t.stride(0) if t.shape[0] > 1 else math.prod(t.shape[1:])


def _call(name: str, rc: int) -> None:
    if rc:
        raise ValueError(f"{name} rejected its sizes")


def add_square(hidden: torch.Tensor, other: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, y.float() ** 2)`` for ``y = hidden + other`` (``hidden`` when ``other`` is None):
    ``hidden``, ``other`` ``[T, N]`` of one dtype with contiguous rows."""
    rows, n = hidden.shape
    dtype = hidden.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"add_square: float32 or bfloat16, got {dtype}")
    check_rows("hidden", hidden, rows, n, dtype)
    sq = torch.empty(rows, n, dtype=torch.float32)
    if other is None:
        out, optr, ostride = hidden, None, n
    else:
        check_rows("other", other, rows, n, dtype)
        out = torch.empty(rows, n, dtype=dtype)
        optr, ostride = other.data_ptr(), _stride(other)
    if rows == 0 or n == 0:
        return out, sq
    _call(
        "cbgen_parity_add_square",
        library().cbgen_parity_add_square(
            hidden.data_ptr(),
            _stride(hidden),
            optr,
            ostride,
            out.data_ptr(),
            n,
            sq.data_ptr(),
            rows,
            n,
            _DTYPES[dtype],
        ),
    )
    return out, sq


def norm_apply(x: torch.Tensor, sums: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """``weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)`` with ``variance = sums / N``
    (torch's ``mean``: its sum divided by the count) for ``x [T, N]`` (contiguous rows), ``sums``
    float32 with ``T`` elements (each row's sum of squares), ``weight [N]`` of x's dtype."""
    rows, n = x.shape
    dtype = x.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"norm_apply: float32 or bfloat16, got {dtype}")
    check_rows("x", x, rows, n, dtype)
    if sums.numel() != rows or sums.dtype != torch.float32 or sums.device.type != "cpu":
        raise ValueError(
            f"norm_apply: sums must be {rows} float32 values, got {sums.dtype} {list(sums.shape)}"
        )
    if weight.shape != (n,) or weight.dtype != dtype or weight.device.type != "cpu":
        raise ValueError(
            f"norm_apply: weight must be a CPU [{n}] {dtype} tensor, got {weight.dtype} {list(weight.shape)}"
        )
    sums, weight = sums.contiguous(), weight.contiguous()
    out = torch.empty(rows, n, dtype=dtype)
    if rows == 0 or n == 0:
        return out
    _call(
        "cbgen_parity_norm_apply",
        library().cbgen_parity_norm_apply(
            x.data_ptr(),
            _stride(x),
            sums.data_ptr(),
            eps,
            weight.data_ptr(),
            out.data_ptr(),
            n,
            rows,
            n,
            _DTYPES[dtype],
        ),
    )
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``) for ``x [T, H, D]``
    (heads and head_dim contiguous, any row stride), ``cos`` and ``sin`` ``[T, D]`` of x's dtype
    (contiguous rows, the same row stride); returns a contiguous ``[T, H, D]``."""
    if x.dim() != 3 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(
            f"rope: x must be a CPU [T, H, D] float32 or bfloat16 tensor, got {x.dtype} {list(x.shape)}"
        )
    t, h, d = x.shape
    if d % 2 or (t and h and (x.stride(2) != 1 or x.stride(1) != d)):
        raise ValueError(
            f"rope: x needs an even head_dim with heads and head_dim contiguous, got strides {x.stride()}"
        )
    check_rows("cos", cos, t, d, x.dtype)
    check_rows("sin", sin, t, d, x.dtype)
    if _stride(cos) != _stride(sin):
        raise ValueError("rope: cos and sin must share a row stride")
    out = torch.empty(t, h, d, dtype=x.dtype)
    if t == 0 or h == 0 or d == 0:
        return out
    _call(
        "cbgen_parity_rope",
        library().cbgen_parity_rope(
            x.data_ptr(),
            _stride(x),
            h,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            _stride(cos),
            out.data_ptr(),
            h * d,
            t,
            _DTYPES[x.dtype],
        ),
    )
    return out


def mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a * b`` for ``a``, ``b`` ``[T, N]`` of one dtype with contiguous rows, into ``out`` (a new
    contiguous tensor when None; ``a`` itself may be given)."""
    rows, n = a.shape
    dtype = a.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"mul: float32 or bfloat16, got {dtype}")
    check_rows("a", a, rows, n, dtype)
    check_rows("b", b, rows, n, dtype)
    if out is None:
        out = torch.empty(rows, n, dtype=dtype)
    check_rows("out", out, rows, n, dtype)
    if rows == 0 or n == 0:
        return out
    _call(
        "cbgen_parity_mul",
        library().cbgen_parity_mul(
            a.data_ptr(),
            _stride(a),
            b.data_ptr(),
            _stride(b),
            out.data_ptr(),
            _stride(out),
            rows,
            n,
            _DTYPES[dtype],
        ),
    )
    return out


# The vector exp torch's CPU kernels call (Vectorized<float>::exp), per the capability torch
# dispatches its kernels to here, with its width in float32 lanes.
_TORCH_EXP = {"AVX512": ("Sleef_expf16_u10", 16), "AVX2": ("Sleef_expf8_u10", 8)}


@functools.cache
def torch_vector_exp() -> tuple[int, int] | None:
    """``(address, width)`` of the vector exp torch's kernels use on this CPU (found in the loaded
    libtorch_cpu), or None where torch dispatches to another capability or the symbol is missing.
    Whether :func:`silu_mul` with it equals torch's SiLU is the caller's check."""
    entry = _TORCH_EXP.get(torch.backends.cpu.get_cpu_capability())
    if entry is None:
        return None
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        # RTLD_NOLOAD: the copy this process already runs, never a second one.
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        address = ctypes.cast(getattr(lib, entry[0]), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return (address, entry[1]) if address else None


def silu_mul(gate_up: torch.Tensor, inter: int, exp: tuple[int, int]) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 inter]`` (the gate's columns first; contiguous rows)
    as torch computes SiLU over whole vectors, each element x / (1 + exp(-x)) with ``exp``
    (:func:`torch_vector_exp`'s answer) and rounded to the dtype, then the product rounded; returns
    a new contiguous ``[T, inter]``."""
    rows, n = gate_up.shape
    dtype = gate_up.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"silu_mul: float32 or bfloat16, got {dtype}")
    if n != 2 * inter:
        raise ValueError(f"silu_mul: gate_up has {n} columns, not 2 x {inter}")
    check_rows("gate_up", gate_up, rows, n, dtype)
    address, width = exp
    out = torch.empty(rows, inter, dtype=dtype)
    if rows == 0 or inter == 0:
        return out
    rc = library().cbgen_parity_silu_mul(
        gate_up.data_ptr(),
        _stride(gate_up),
        inter,
        out.data_ptr(),
        inter,
        rows,
        address,
        width,
        _DTYPES[dtype],
    )
    if rc:
        raise ValueError(
            "cbgen_parity_silu_mul "
            + ("was built without that vector width" if rc == 2 else "rejected its sizes")
        )
    return out
