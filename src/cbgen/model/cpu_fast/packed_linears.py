"""Pre-packed copies of projection weights for the fused CPU forward (:mod:`cbgen.model.cpu_fast.fused_forward`).

MKL and oneDNN (float32 and bfloat16) and the AMX kernel (bfloat16) each run a GEMM faster from
weights reordered once into their own layout than from the user's tensor at every call.  Which of
them runs decode steps and which prefill steps is a :class:`cbgen.model.cpu_fast.gemm_choice.GemmPlan`,
measured on the machine; this keeps the copies those winners need and rebuilds one whenever its
weight changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from cbgen.model.cpu_fast.gemm_choice import AMX_MAX_ROWS, GemmPlan, default_plan

__all__ = ["AMX_MAX_ROWS", "PackedLinears", "packable"]

# Below this a packed GEMM's call overhead (~90 us measured at 256 x 64 x 64) outweighs its gain.
_PACK_MIN_ELEMS = 1 << 16


def packable(numel: int) -> bool:
    """Whether a projection group of ``numel`` weights gets packed copies (smaller groups run plain
    GEMMs, so neither a packed GEMM nor the one-call C step, which reads packed copies, serves them)."""
    return numel >= _PACK_MIN_ELEMS


def _stamp(modules: tuple[nn.Linear, ...]) -> list[int]:
    """What identifies the values of ``modules``' weights and biases: tensor, version, storage (as
    ints, so a check is one list comparison; the cache entry holds the tensors, so ids stay valid)."""
    out: list[int] = []
    for m in modules:
        for t in (m.weight, m.bias):
            if t is not None:
                out += (id(t), t._version, t.data_ptr())
    return out


@dataclass
class PackedEntry:
    """The copies of one projection group (one module, or q/k/v or gate/up run as one GEMM).

    ``packed`` maps a candidate name to its copy; ``weight`` is the plain weight the candidates
    read (a concatenated copy only for small groups; otherwise a zero-stride stand-in of the right
    shape, or None for a single module, whose own weight is used); ``widths`` splits a group's
    output (None for one module)."""

    stamp: list[int]
    packed: dict[str, Any]
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    held: list[torch.Tensor]
    widths: list[int] | None


class PackedLinears:
    """Pre-packed copies of linear weights, each rebuilt when its weight changes.

    :meth:`group` runs several projections of the same input (q/k/v, gate/up) as one GEMM over their
    concatenated packed weights: one call instead of three, and wide enough to keep the matrix units
    busy (oneDNN's bf16 GEMM ran the 192-wide k/v projections at a quarter of its speed at 960).

    A weight is repacked when its tensor, version counter (in-place updates, optimizer steps) or
    storage (``.data =`` / ``load_state_dict``) differs from what was packed, and likewise for the
    biases; :meth:`clear` covers writes no counter sees (through ``.data``), via
    ``notify_weights_updated``.  Costs one extra copy of every projection weight per packing winner.
    """

    def __init__(self, dtype: torch.dtype, enabled: bool = True, plan: GemmPlan | None = None) -> None:
        self.plan = plan if plan is not None else default_plan(dtype)
        self._enabled = enabled and bool(self.plan.packs)
        self._cache: dict[tuple[int, ...], PackedEntry] = {}
        self.generation = 0  # changes whenever an entry is made or dropped

    @property
    def enabled(self) -> bool:
        """Whether some winner of the plan packs weights (else every GEMM is plain)."""
        return self._enabled

    def clear(self) -> None:
        """Drops every packed copy (they are rebuilt on the next use)."""
        self._cache.clear()
        self.generation += 1

    def __call__(self, x: torch.Tensor, module: nn.Linear, checked: bool = True) -> torch.Tensor:
        """``F.linear(x, module.weight, module.bias)`` (``checked``: see :meth:`group`)."""
        return self.group(x, (module,), checked)[0]

    def group(
        self, x: torch.Tensor, modules: tuple[nn.Linear, ...], checked: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """``F.linear(x, m.weight, m.bias)`` for each of ``modules`` (same input width): column slices
        of one output when packed (row stride = the summed widths), else separate tensors.

        ``checked=False`` skips comparing the weights' stamps with the packed copy's: for a caller
        that saw no weight change since the copy was made (:class:`FusedDecoder` checks every
        parameter's version once a step, which costs less than ~120 per-call stamps)."""
        entry = self.entry(modules, checked)
        if entry is None:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        cand = self.plan.for_rows(x.shape[0])
        out = None
        if cand.pack is not None:
            packed = entry.packed.get(cand.name)
            if packed is not None:
                weight = entry.weight if entry.weight is not None else modules[0].weight
                out = cand.apply(x, packed, weight, entry.bias)
        elif entry.weight is not None and entry.widths is not None and entry.weight.stride(1) == 1:
            out = F.linear(x, entry.weight, entry.bias)  # a small group's concatenated copy
        if out is None:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        return (out,) if entry.widths is None else out.split(entry.widths, dim=1)

    def entry(self, modules: tuple[nn.Linear, ...], checked: bool = True) -> PackedEntry | None:
        """The cache entry of ``modules``, made now if missing or (``checked``) stale; None when
        nothing is packed."""
        if not self._enabled:
            return None
        key = tuple(map(id, modules))
        entry = self._cache.get(key)
        if entry is None or (checked and entry.stamp != _stamp(modules)):
            try:
                entry = self._pack(modules)
            except RuntimeError:  # this build or CPU cannot: plain linears from now on
                self._enabled = False
                self._cache.clear()
                return None
            self._cache[key] = entry
            self.generation += 1
        return entry

    def _pack(self, modules: tuple[nn.Linear, ...]) -> PackedEntry:
        """The copies for ``modules``.  Small weights gain nothing from packing (call overhead): a
        group of them runs as one plain GEMM over a concatenated copy (a few hundred KiB at most), a
        single one as its own ``F.linear``."""
        held = [t for m in modules for t in (m.weight, m.bias) if t is not None]
        widths = None if len(modules) == 1 else [m.weight.shape[0] for m in modules]
        small = not packable(sum(m.weight.numel() for m in modules))
        if small and len(modules) == 1:
            return PackedEntry(_stamp(modules), {}, None, None, held, None)
        with torch.no_grad():
            weights = [m.weight.detach() for m in modules]
            weight = weights[0] if len(modules) == 1 else torch.cat(weights)
            bias = None
            if any(m.bias is not None for m in modules):
                bias = torch.cat(
                    [
                        m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                        for m, w in zip(modules, weights)
                    ]
                )
            if small:
                return PackedEntry(_stamp(modules), {}, weight, bias, held, widths)
            packed = {c.name: c.pack(weight) for c in self.plan.packs}
            # The apply ops read only the shape of the plain weight: a zero-stride stand-in keeps no
            # second copy (single modules pass their own weight).
            shape_ref = None if len(modules) == 1 else weight.new_zeros(1, 1).expand(weight.shape)
            return PackedEntry(_stamp(modules), packed, shape_ref, bias, held, widths)
