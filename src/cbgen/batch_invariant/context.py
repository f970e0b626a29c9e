"""``cbgen.parity(model)``: the trainer-side context under which ``model``'s forward computes exactly
what the engine computes in parity mode (``LLM(..., batch_invariant=True)``).

While the context is entered, on the thread that entered it:

* the model's attention implementation is cbgen's parity attention
  (:mod:`cbgen.batch_invariant.trainer_attention`), set on its config objects the way the engine's runner
  sets its paged attention, and restored on exit;
* :class:`cbgen.batch_invariant.dispatch.ParityOps` is active, so matrix products and transcendental
  functions are batch-invariant;
* a forward pre-hook on ``model`` (removed on exit) reads each call's ``attention_mask``: it passes
  each row's token positions to the attention and, when the call gives no ``position_ids``, sets
  them from the mask (left-padded rows then get positions 0, 1, ... from their first real token,
  as the engine gives them).

The model's code, parameters, training mode and global torch state are not touched; backward passes
run inside or outside the context (inside, their matrix products go through the same tiles).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from cbgen.batch_invariant import trainer_attention
from cbgen.batch_invariant.dispatch import ParityOps
from cbgen.batch_invariant.trainer_attention import RowPositions
from cbgen.model.attention import attention_configs


def _add_positions(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """Forward pre-hook: the row positions from the call's mask (see the module docstring)."""
    mask = kwargs.get("attention_mask")
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return args, kwargs
    layout = RowPositions.from_mask(mask)
    kwargs = dict(kwargs, cbgen_parity=layout)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = layout.positions.clamp(min=0)
    return args, kwargs


@contextlib.contextmanager
def parity(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Runs ``model``'s forwards (and the backwards started inside) in parity mode; yields ``model``.

    ``with cbgen.parity(model): logits = model(input_ids, attention_mask=mask).logits``, then
    :func:`cbgen.batch_invariant.logprobs.token_logprobs` gives, for every token an engine with
    ``batch_invariant=True`` generated from the same weights, exactly its ``raw_logprobs``.
    Pass the mask as ``attention_mask=`` (a keyword) for padded batches."""
    name = trainer_attention.register()
    saved = [(cfg, cfg._attn_implementation_internal) for cfg in attention_configs(model)]
    handle = model.register_forward_pre_hook(_add_positions, with_kwargs=True)
    try:
        for cfg, _ in saved:
            cfg._attn_implementation_internal = name
        with ParityOps():
            yield model
    finally:
        handle.remove()
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl
