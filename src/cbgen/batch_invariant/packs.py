"""The engine's packed copies of a model's weights for parity mode's GEMMs.

Parity mode's matrix products read their weight packed
(:func:`cbgen.batch_invariant.kernels.cpu_parity.parity_pack`: panels of 16 columns for the float32
panel GEMM, or of 32 columns by k pairs for the bfloat16 pair GEMM).  The trainer side packs each weight as it is
used (a copy per call, small next to a training forward over thousands of rows, and no second copy of
the model held).  The engine reuses the same weights for every step, so it keeps one packed copy per
weight here, made on first use and dropped whenever the engine sees the weights change.  Packing only
rearranges values (or widens bfloat16 exactly), so a packed copy gives the same bits as packing again.

Only the model's own 2-D parameters are kept, found by their storage: an activation can never share
a live parameter's address, so no other product can be served a stale copy.
"""

from __future__ import annotations

import torch

from cbgen.batch_invariant.kernels.cpu_parity import parity_pack


class WeightPacks:
    """``model``'s 2-D floating-point parameters packed for
    :func:`cbgen.batch_invariant.kernels.cpu_parity.parity_linear`, by storage address."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._params: dict[int, torch.Tensor] = {}
        self._packed: dict[int, torch.Tensor] = {}
        self.clear()

    def clear(self) -> None:
        """Drops every packed copy and re-reads the parameter list (after a weight change)."""
        self._packed.clear()
        self._params = {
            p.data_ptr(): p for p in self.model.parameters() if p.dim() == 2 and p.is_floating_point()
        }

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` (``[N, K]``) packed, when it is one of the model's parameters, else None."""
        key = weight.data_ptr()
        param = self._params.get(key)
        if param is None or param.shape != weight.shape or param.stride() != weight.stride():
            return None
        packed = self._packed.get(key)
        if packed is None:
            packed = self._packed[key] = parity_pack(weight.detach())
        return packed
