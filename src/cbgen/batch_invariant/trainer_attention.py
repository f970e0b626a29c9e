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
from cbgen.batch_invariant.native import parity_form
from cbgen.model.kernels.cpu.parity import parity_attention
from cbgen.model.kernels.triton.parity import triton_parity_attention

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
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"{type(module).__name__} uses attention sinks, which cbgen.parity does not implement"
        )
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
    form = parity_form(q.device, q.dtype) if k.dtype == q.dtype else "torch"
    if form != "torch":
        kernel = parity_attention if form == "c" else triton_parity_attention
        return _NativeAttention.apply(q, k, v, pos, scale, sliding_window, softcap, kernel), None
    return blocked_attention(q, k, v, pos, scale, sliding_window, softcap), None


class _NativeAttention(torch.autograd.Function):
    """A parity attention kernel's forward (C or Triton); a backward from a plain float32
    recomputation (gradients need no invariance, and the kernels have no backward)."""

    @staticmethod
    def forward(ctx, q, k, v, pos, scale, sliding_window, softcap, kernel):
        batch, length, heads, dim = q.shape
        dev = q.device
        # The batch as a paged cache: one block per row, the row's keys at their absolute positions.
        out = kernel(
            q.reshape(batch * length, heads, dim),
            k.contiguous(),
            v.contiguous(),
            torch.arange(batch, dtype=torch.int32, device=dev)[:, None],
            torch.zeros(batch, dtype=torch.long, device=dev),
            torch.arange(batch, device=dev).repeat_interleave(length),
            pos.reshape(-1).to(torch.long),
            scale,
            sliding_window,
            softcap,
        )
        ctx.save_for_backward(q, k, v, pos)
        ctx.settings = (scale, sliding_window, softcap)
        return out.view(batch, length, heads, dim)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, pos = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = reference_attention(*leaves, pos, *ctx.settings)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype)))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None, None, None)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Plain attention in float32 over keys laid out by position (``[B, L, H|Hkv, D]``, ``pos [B, L]``
    with -1 for padding, as :func:`parity_attention_forward` passes them): what the parity kernels
    compute, in no particular order; differentiable, for the backward pass."""
    heads, kv_heads = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2)
    vf = v.float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), kf) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    length = pos.shape[1]
    key_pos = torch.arange(length, device=pos.device)  # k and v are laid out by position
    p = pos[:, None, :, None]
    visible = (key_pos <= p) & (p >= 0)
    if sliding_window:
        visible = visible & (key_pos > p - sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, vf).to(q.dtype)


_registered = False


def register() -> str:
    """Registers :func:`parity_attention_forward` with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, parity_attention_forward)
        _registered = True
    return ATTN_NAME
