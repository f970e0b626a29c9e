"""The dispatch mode active around every parity forward, on the engine's side and the trainer's.

A :class:`torch.utils._python_dispatch.TorchDispatchMode` sees each aten op below autograd, on the
thread that entered it only, and only while entered: the model's code, its modules and global torch
state stay as they are, and backward formulas are autograd's own.  Inside ``__torch_dispatch__`` the
mode is off, so the calls made there reach the real kernels.

It changes two kinds of op, and lets every other one through unchanged:

* matrix products (``linear`` and ``matmul`` where inference mode keeps them whole, ``mm``, ``addmm``,
  ``bmm``, ``baddbmm``, ``_grouped_mm``): in fixed row tiles
  (:mod:`cbgen.batch_invariant.tiled_matmul`), so each row is reduced in an order independent of the batch;
* elementwise transcendental functions (``silu``, ``gelu``, ``tanh``, ``sigmoid``, ``exp``, ``log``,
  ``sin``, ``cos``, ``erf``): through whole vectors only (:mod:`cbgen.batch_invariant.lanes`), so each element's
  value depends on itself alone.

Ops run by a backward pass (autograd's graph task) pass unchanged: gradients need no invariance.
The exception is a checkpointed layer's recomputation, a forward that runs inside the backward: it
must give the forward's activations to the bit, so its mode is entered with ``replay=True``
(:mod:`cbgen.batch_invariant.context`).

Per-row reductions (RMSNorm's mean, softmax, log_softmax) already reduce each row in an order set by
the row's length, and exact elementwise ops (add, mul, div, sqrt, rsqrt) give the same bits
anywhere, so they pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbgen.batch_invariant.lanes import lanewise
from cbgen.batch_invariant.packs import WeightPacks
from cbgen.batch_invariant.tiled_matmul import tiled_bmm, tiled_grouped_mm, tiled_mm

aten = torch.ops.aten


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return aten.mm.default(a, b)


def _float_2d(*ts: torch.Tensor) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in ts)


def _scale(out: torch.Tensor, alpha) -> torch.Tensor:
    return out if alpha == 1 else out * alpha


def _add_input(out: torch.Tensor, base: torch.Tensor, beta) -> torch.Tensor:
    if beta == 0:
        return out
    return out + (base if beta == 1 else base * beta)


def _mm_op(packs, a, b):
    return tiled_mm(_mm, a, b, packs) if _float_2d(a, b) else aten.mm.default(a, b)


def _mm_out(packs, a, b, *, out):
    return out.copy_(_mm_op(packs, a, b))


def _addmm(packs, base, a, b, *, beta=1, alpha=1):
    if not _float_2d(a, b):
        return aten.addmm.default(base, a, b, beta=beta, alpha=alpha)
    return _add_input(_scale(tiled_mm(_mm, a, b, packs), alpha), base, beta)


def _bmm(packs, a, b):
    return tiled_bmm(_mm, a, b) if _float_2d(a, b) else aten.bmm.default(a, b)


def _baddbmm(packs, base, a, b, *, beta=1, alpha=1):
    if not _float_2d(a, b):
        return aten.baddbmm.default(base, a, b, beta=beta, alpha=alpha)
    return _add_input(_scale(tiled_bmm(_mm, a, b), alpha), base, beta)


def _grouped_mm(packs, a, b, offs=None, bias=None, out_dtype=None):
    out = tiled_grouped_mm(_mm, a, b, offs)
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)


def _linear(packs, x, weight, bias=None):
    if not _float_2d(x, weight):
        return aten.linear.default(x, weight, bias)
    out = tiled_mm(_mm, x.reshape(-1, x.shape[-1]), weight.t(), packs)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _matmul(packs, a, b):
    # Under inference mode aten.matmul reaches the mode whole; the shapes models use it for.
    if _float_2d(a, b) and b.dim() == 2 and a.dim() >= 2:
        return tiled_mm(_mm, a.reshape(-1, a.shape[-1]), b, packs).view(*a.shape[:-1], b.shape[-1])
    if _float_2d(a, b) and a.dim() == b.dim() >= 3 and a.shape[:-2] == b.shape[:-2]:
        flat = tiled_bmm(_mm, a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
        return flat.view(*a.shape[:-1], b.shape[-1])
    if a.dim() >= 1 and a.shape[-1] > 1:
        raise NotImplementedError(f"parity mode: no batch-invariant matmul for shapes {a.shape} @ {b.shape}")
    return aten.matmul.default(a, b)


def _lanewise(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(_packs, x, *args, **kwargs):
        return lanewise(op, x, *args, **kwargs)

    return run


_HANDLERS: dict = {
    aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.mm.default: _mm_op,
    aten.mm.out: _mm_out,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten._grouped_mm.default: _grouped_mm,
}
for _op in ("silu", "gelu", "tanh", "sigmoid", "exp", "log", "sin", "cos", "erf"):
    _HANDLERS[getattr(aten, _op).default] = _lanewise(getattr(aten, _op).default)


def in_backward() -> bool:
    """Whether the calling thread is running a backward pass (an autograd graph task)."""
    return torch._C._current_graph_task_id() != -1


class ParityOps(TorchDispatchMode):
    """Batch-invariant matrix products and transcendental functions for the ops run while it is
    entered (``with ParityOps(): ...``), on this thread (see the module docstring).  ``packs``: the
    engine's packed weights (:class:`cbgen.batch_invariant.packs.WeightPacks`); without them each
    product packs its weight for the call, with the same result.  ``replay``: handle ops inside a
    backward pass too (a checkpointed layer's recomputation)."""

    def __init__(self, packs: WeightPacks | None = None, replay: bool = False) -> None:
        super().__init__()
        self.packs = packs
        self.replay = replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        # Backward passes (a graph task running) need no invariance: their real kernels are faster.
        if handler is None or (not self.replay and in_backward()):
            return func(*args, **(kwargs or {}))
        return handler(self.packs, *args, **(kwargs or {}))


def handled_ops() -> list[str]:
    """The aten ops the mode computes its own way (for ``cbgen info`` and the docs)."""
    return sorted(str(op) for op in _HANDLERS)
