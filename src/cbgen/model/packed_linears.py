"""Pre-packed copies of projection weights for the fused CPU forward (:mod:`cbgen.model.fused_decode`).

MKL (float32), oneDNN and the AMX kernel (bfloat16) each run a GEMM faster from weights reordered
once into their own layout than from the user's tensor at every call; this keeps those copies and
rebuilds one whenever its weight changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from cbgen.model import cpu_amx


def _pack_ops(dtype: torch.dtype):
    """(pack, apply) for weights the CPU reorders once instead of at every call, or None.

    ``apply(x, packed, weight, bias)`` returns ``F.linear(x, weight, bias)`` from the packed copy, or
    None for an input it does not serve (the caller then runs plain linears).
    - float32: MKL's packed GEMM, identical to ``F.linear``; it only runs at the row count it packed
      for (any other count falls back to a plain GEMM inside MKL), so other counts get None.
    - bfloat16: the AMX kernel of ``csrc/cpu_gemm.c`` where the CPU has AMX (up to
      ``AMX_MAX_ROWS`` rows; weights whose sides are not multiples of 32 go to oneDNN), else
      oneDNN's packed GEMM (identical to ``F.linear``).
    """
    try:
        if dtype == torch.float32 and torch._C.has_mkl:
            mkl = torch.ops.mkl

            def mkl_apply(x, packed, w, b):
                return mkl._mkl_linear(x, packed, w, b, _PACK_ROWS) if x.shape[0] == _PACK_ROWS else None

            return (lambda w: mkl._mkl_reorder_linear_weight(w, _PACK_ROWS), mkl_apply)
        if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            dnn = torch.ops.mkldnn
            if not dnn._is_mkldnn_bf16_supported():
                return None
            amx = cpu_amx.amx_available()

            def bf16_pack(w):
                if amx and cpu_amx.amx_supports(w):
                    return cpu_amx.amx_pack(w)
                return dnn._reorder_linear_weight(w, _PACK_ROWS)

            def bf16_apply(x, packed, w, b):
                if packed.dim() != 6:  # oneDNN's
                    return dnn._linear_pointwise(x, packed, b, "none", [], "")
                return cpu_amx.amx_linear(x, packed, b) if x.shape[0] <= AMX_MAX_ROWS else None

            return (bf16_pack, bf16_apply)
    except (AttributeError, RuntimeError):
        pass
    return None


# MKL's packed GEMM only runs at the row count it packed for; 64 rows is where packing pays most
# (small-M GEMMs, ~20% faster) and oneDNN's hint.
_PACK_ROWS = 64
# Below this a packed GEMM's call overhead (~90 us measured at 256 x 64 x 64) outweighs its gain.
_PACK_MIN_ELEMS = 1 << 16
# Above this many rows torch's own bf16 GEMM takes over.  Hot, it beats the AMX kernel from ~1,024
# rows; inside an engine step, where the weights arrive cold, the AMX kernel still ran prefill steps
# of 2,048 tokens ~20% faster (530-590 against 690 ms a step), so the default token budget stays on it.
AMX_MAX_ROWS = 4096
# (weight, bias) fields of each projection group (q/k/v, o, gate/up, down) in the one-call decoder
# step's layer records (csrc/cpu_decoder.c).


def _stamp(modules: tuple[nn.Linear, ...]) -> list[int]:
    """What identifies the values of ``modules``' weights and biases: tensor, version, storage (as
    ints, so a check is one list comparison; the cache entry holds the tensors, so ids stay valid)."""
    out: list[int] = []
    for m in modules:
        for t in (m.weight, m.bias):
            if t is not None:
                out += (id(t), t._version, t.data_ptr())
    return out


class PackedLinears:
    """Pre-packed copies of linear weights, each rebuilt when its weight changes.

    :meth:`group` runs several projections of the same input (q/k/v, gate/up) as one GEMM over their
    concatenated packed weights: one call instead of three, and wide enough to keep the matrix units
    busy (oneDNN's bf16 GEMM ran the 192-wide k/v projections at a quarter of its speed at 960).

    A weight is repacked when its tensor, version counter (in-place updates, optimizer steps) or
    storage (``.data =`` / ``load_state_dict``) differs from what was packed, and likewise for the
    biases; :meth:`clear` covers writes no counter sees (through ``.data``), via
    ``notify_weights_updated``.  Costs one extra copy of every projection weight.
    """

    def __init__(self, dtype: torch.dtype, enabled: bool = True) -> None:
        self._ops = _pack_ops(dtype) if enabled else None
        self._cache: dict[tuple[int, ...], tuple] = {}
        self.generation = 0  # changes whenever an entry is made or dropped

    @property
    def enabled(self) -> bool:
        """Whether this torch build can pack weights of the dtype."""
        return self._ops is not None

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
        packed = entry[1]
        if packed is not None:
            out = self._ops[1](x, packed, entry[2], entry[3])
            if out is None:
                return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        elif entry[2] is not None:
            out = F.linear(x, entry[2], entry[3])
        else:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        return (out,) if entry[5] is None else out.split(entry[5], dim=1)

    def entry(self, modules: tuple[nn.Linear, ...], checked: bool = True) -> tuple | None:
        """The cache entry of ``modules`` (see :meth:`_pack`), made now if missing or (``checked``)
        stale; None when this build cannot pack."""
        if self._ops is None:
            return None
        key = tuple(map(id, modules))
        entry = self._cache.get(key)
        if entry is None or (checked and entry[0] != _stamp(modules)):
            try:
                entry = self._pack(modules)
            except RuntimeError:  # this build or CPU cannot: plain linears from now on
                self._ops = None
                self._cache.clear()
                return None
            self._cache[key] = entry
            self.generation += 1
        return entry

    def _pack(self, modules: tuple[nn.Linear, ...]) -> tuple:
        """(stamp, packed weight or None, plain weight or its shape stand-in or None, bias, the
        stamped tensors, output widths or None for one module) for ``modules``.  Small weights gain
        nothing from packing (call overhead): a group of them runs as one plain GEMM over a
        concatenated copy (a few hundred KiB at most), a single one as its own ``F.linear``
        (packed and plain weight both None)."""
        held = [t for m in modules for t in (m.weight, m.bias) if t is not None]
        widths = None if len(modules) == 1 else [m.weight.shape[0] for m in modules]
        small = sum(m.weight.numel() for m in modules) < _PACK_MIN_ELEMS
        if small and len(modules) == 1:
            return (_stamp(modules), None, None, None, held, None)
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
                return (_stamp(modules), None, weight, bias, held, widths)
            # The apply ops read only the shape of the plain weight (they return None for inputs
            # they do not serve): a zero-stride stand-in keeps no second copy.
            shape_ref = weight if len(modules) == 1 else weight.new_zeros(1, 1).expand(weight.shape)
            return (_stamp(modules), self._ops[0](weight), shape_ref, bias, held, widths)
