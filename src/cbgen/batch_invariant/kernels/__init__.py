"""Parity mode's native kernels, as Python bindings: :mod:`~cbgen.batch_invariant.kernels.cpu_parity`
(the fixed-order GEMM, paged attention and token logprobs in C),
:mod:`~cbgen.batch_invariant.kernels.cpu_parity_rows` (the direct forward's exact elementwise steps
in C) and :mod:`~cbgen.batch_invariant.kernels.triton_parity` (the Triton GEMM and attention).

Their C sources stay with the others in ``cbgen/model/kernels/cpu/csrc/`` and are compiled with them
into one library by :mod:`cbgen.model.kernels.cpu.ops`; the Triton kernels reuse the helpers of
:mod:`cbgen.model.kernels.triton.ops`.  So this package imports ``model.kernels`` and never the other
way round (``tests/test_layering.py``).
"""
