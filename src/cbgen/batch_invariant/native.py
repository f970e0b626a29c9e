"""Which implementation of parity mode's matrix products and attention runs: the one decision both
sides make the same way, so the engine and ``cbgen.parity(model)`` always run the same code.

On the CPU, for float32 and bfloat16, with the C kernels built: ``csrc/cpu_parity.c``
(:mod:`cbgen.model.kernels.cpu.parity`), each output element in one fixed order, about as fast as
the library GEMM.  Anywhere else (other devices and dtypes, no C compiler): the torch forms, row
tiles of one shape (:mod:`cbgen.batch_invariant.tiled_matmul`) and the blocked attention core
(:mod:`cbgen.batch_invariant.attention_core`), also fixed-order but several times slower.  The two
forms give different bits, so a process never mixes them for one dtype and device.
"""

from __future__ import annotations

import torch

from cbgen.model.kernels.cpu.parity import parity_kernels_available


def native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` on ``device`` take the C parity kernels (see the module docstring)."""
    return device.type == "cpu" and parity_kernels_available(dtype)


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """One line for the execution plan: which form runs, and why."""
    if native(device, dtype):
        return "the C parity kernels (fixed-order GEMM and attention)"
    return (
        f"the torch forms (row-tiled GEMM, blocked attention): no C parity kernels for {device.type}, {dtype}"
    )
