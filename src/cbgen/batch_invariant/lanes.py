"""Elementwise transcendental ops evaluated the same way for every element, whatever the tensor's size.

torch's CPU elementwise loops run the vectorised kernel (Sleef) over whole vectors and a scalar one
(libm) over the last few elements of each thread's chunk; the two can differ in the last bit, so an
element's ``silu`` or ``cos`` depends on where it sits in the tensor, hence on the batch.  Here every
call runs on one thread (chunks below torch's parallel grain) over whole vectors only (sizes padded to
:data:`LANE_MULTIPLE`), so each element goes through the vectorised kernel: its result depends on its
own value alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# A multiple of twice the widest vector torch uses (AVX-512: 16 float32 lanes, 32 bfloat16), so no
# element ever reaches the scalar tail of the vectorised loop.
LANE_MULTIPLE = 64
# Below torch's parallel grain (at::internal::GRAIN_SIZE, 32768): one thread, one chunk per call.  A
# multiple of LANE_MULTIPLE, so chunks of a tensor split at it start on whole vectors.
CHUNK = 32768 - LANE_MULTIPLE


def lanewise(op: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``op(x, *args, **kwargs)`` for an elementwise ``op``, with every element computed by the
    vectorised kernel (see the module docstring).  Off the CPU the op runs as it is (GPU kernels
    have no scalar tail)."""
    if x.device.type != "cpu" or not x.is_floating_point():
        return op(x, *args, **kwargs)
    n = x.numel()
    if n % LANE_MULTIPLE == 0 and n <= CHUNK and x.is_contiguous():
        return op(x, *args, **kwargs)
    padded = -(-n // LANE_MULTIPLE) * LANE_MULTIPLE
    buf = x.new_zeros(padded)
    buf[:n] = x.reshape(-1)
    out = torch.cat([op(buf[i : i + CHUNK], *args, **kwargs) for i in range(0, padded, CHUNK)])
    return out[:n].view(x.shape)


def lanewise_(op_: Callable[..., torch.Tensor], x: torch.Tensor) -> bool:
    """Applies the in-place elementwise ``op_`` (``aten.silu_``) to a contiguous CPU ``x`` whose size
    is a multiple of :data:`LANE_MULTIPLE`, each element by the vectorised kernel as in
    :func:`lanewise` (chunks of whole vectors below the parallel grain), without :func:`lanewise`'s
    padded copy and concatenation.  Returns False, touching nothing, for any other ``x``."""
    n = x.numel()
    if x.device.type != "cpu" or not x.is_floating_point() or not x.is_contiguous() or n % LANE_MULTIPLE:
        return False
    flat = x.view(-1)
    for i in range(0, n, CHUNK):
        op_(flat[i : i + CHUNK])
    return True
