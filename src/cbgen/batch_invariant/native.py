"""Which implementation of parity mode's matrix products and attention runs: the one decision both
sides make the same way, so the engine and ``cbgen.parity(model)`` always run the same code.

* ``c``: on the CPU, for float32 and bfloat16, with the C kernels built and a CPU with AVX2 + FMA:
  the panel GEMM and ``csrc/cpu_parity.c``'s attention (:mod:`cbgen.batch_invariant.kernels.cpu_parity`),
  each output element in one fixed order, about as fast as the default mode's kernels.
* ``triton``: on CUDA with Triton, float32 / bfloat16 / float16: the kernels of
  :mod:`cbgen.batch_invariant.kernels.triton_parity`, fixed tiles and no split reductions.
* ``torch``: anywhere else (no C compiler, no Triton, other dtypes): row tiles of one shape
  (:mod:`cbgen.batch_invariant.tiled_matmul`) and the blocked attention core
  (:mod:`cbgen.batch_invariant.attention_core`), also fixed-order but several times slower.

The forms give different bits, so a process never mixes them for one dtype and device.
``CBGEN_PARITY_KERNELS`` (``c``, ``triton``, ``torch``) forces one, for tests and comparisons: a
forced form that cannot run here is an error, not a silent fallback.
"""

from __future__ import annotations

import torch

from cbgen import envs
from cbgen.batch_invariant.kernels.cpu_parity import gemm_name, parity_kernels_available
from cbgen.batch_invariant.kernels.triton_parity import triton_parity_available


def parity_form(device: torch.device, dtype: torch.dtype) -> str:
    """``c``, ``triton`` or ``torch`` for tensors of ``dtype`` on ``device`` (see the module docstring)."""
    forced = (envs.get("CBGEN_PARITY_KERNELS") or "auto").strip().lower()
    if forced != "auto":
        return _forced(forced, device, dtype)
    if device.type == "cpu" and parity_kernels_available(dtype):
        return "c"
    if device.type == "cuda" and triton_parity_available(device, dtype):
        return "triton"
    return "torch"


def _forced(form: str, device: torch.device, dtype: torch.dtype) -> str:
    runs = {
        "c": device.type == "cpu" and parity_kernels_available(dtype),
        "triton": triton_parity_available(device, dtype),
        "torch": True,
    }
    if form not in runs:
        raise ValueError(f"CBGEN_PARITY_KERNELS={form!r}: choose auto, c, triton or torch")
    if not runs[form]:
        raise RuntimeError(
            f"CBGEN_PARITY_KERNELS={form}: those kernels cannot run on {device.type} for {dtype}"
        )
    return form


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """One line for the execution plan: which form runs, and why."""
    form = parity_form(device, dtype)
    if form == "c":
        return f"the C parity kernels ({gemm_name(dtype)}, fixed-order paged attention)"
    if form == "triton":
        return "the Triton parity kernels (fixed tiles, no split reductions)"
    return (
        f"the torch forms (row-tiled GEMM, blocked attention): no parity kernels for {device.type}, {dtype}"
    )
