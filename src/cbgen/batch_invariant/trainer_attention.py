"""The trainer side's attention in parity mode, registered with transformers' ``AttentionInterface``.

It runs :func:`cbgen.batch_invariant.attention_core.blocked_attention` on a plain ``[B, L]`` batch, padded or
not: each row's keys are laid out by their absolute position (the row's own token count, not the
tensor index), as the engine's paged cache holds them, so left-padded rows attend exactly like an
unpadded sequence.  The positions come from the ``cbgen_parity`` keyword the parity context adds to
each model call (:class:`RowPositions`); without it every row is taken as unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from cbgen.batch_invariant.attention_core import blocked_attention

ATTN_NAME = "cbgen_parity"


@dataclass
class RowPositions:
    """Each token's position in its own sequence, ``[B, L]`` int64, -1 for padding tokens."""

    positions: torch.Tensor

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> RowPositions:
        """From a ``[B, L]`` 0/1 mask (left or right padding): real tokens count from 0 in each row."""
        mask = attention_mask.to(torch.long)
        return cls(torch.where(mask > 0, mask.cumsum(-1) - 1, torch.full_like(mask, -1)))


def parity_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query [B, H, L, D]``, ``key``/``value [B, Hkv, L, D]`` -> ``[B, L, H, D]`` (see the module
    docstring); ``attention_mask`` is unused (visibility comes from the row positions)."""
    if dropout:
        raise ValueError("parity mode computes attention without dropout (set attention_dropout=0)")
    batch, _, length, _ = query.shape
    if key.shape[2] != length:
        raise NotImplementedError(
            "cbgen.parity supports forwards over whole sequences, not decoding with a KV cache "
            "(call the model with use_cache=False or without past_key_values)"
        )
    layout: RowPositions | None = kwargs.get("cbgen_parity")
    if layout is None:
        pos = torch.arange(length, device=query.device).expand(batch, length)
    else:
        pos = layout.positions.to(query.device)
    q = query.transpose(1, 2)  # [B, L, H, D]
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    real = pos >= 0
    if not bool(real.all()):
        # Keys by absolute position: slot p of row b holds row b's p-th real token.
        rows, cols = real.nonzero(as_tuple=True)
        slots = pos[rows, cols]
        k_abs = k.new_zeros(k.shape).index_put((rows, slots), k[rows, cols])
        v_abs = v.new_zeros(v.shape).index_put((rows, slots), v[rows, cols])
        k, v = k_abs, v_abs
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return blocked_attention(q, k, v, pos, scale, sliding_window, softcap), None


_registered = False


def register() -> str:
    """Registers :func:`parity_attention_forward` with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, parity_attention_forward)
        _registered = True
    return ATTN_NAME
