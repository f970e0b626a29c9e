"""The trainer side's attention in parity mode, registered with transformers' ``AttentionInterface``
and ``AttentionMaskInterface`` under one name.

It runs :func:`cbgen.batch_invariant.attention_core.blocked_attention` on a plain ``[B, L]`` batch,
padded or not: each row's keys are laid out by their absolute position (the row's own token count,
not the tensor index), as the engine's paged cache holds them, so left-padded rows attend exactly
like an unpadded sequence.

The positions come from the batch's mask.  transformers builds the mask of every forward through
the mask function registered for the attention implementation in force; cbgen's
(:func:`parity_mask`) builds the whole boolean mask the way transformers' own SDPA mask function
does, checks that it is a causal mask over each row's real tokens (left or right padding, a sliding
window), and hands the attention a :class:`ParityMask` with each token's position in its own row.
So the mask reaches the attention however the model was called (keyword or positional), and a mask
the parity attention cannot reproduce (packed sequences, a bidirectional or custom mask) is refused
instead of ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from cbgen.batch_invariant.attention_core import blocked_attention
from cbgen.batch_invariant.kernels.cpu_parity import parity_attention
from cbgen.batch_invariant.kernels.triton_parity import triton_parity_attention
from cbgen.batch_invariant.native import parity_form

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


@dataclass
class ParityMask:
    """What :func:`parity_mask` gives transformers as a batch's mask: the row positions, and the
    sliding window the mask was built with where it hides a key (None where it hides none)."""

    rows: RowPositions
    window: int | None

    def __getitem__(self, index) -> ParityMask:
        """Gemma 4 slices its masks to the ``logits_to_keep`` query rows before its KV-shared layers;
        with every row kept (a trainer's forward: ``logits_to_keep=0``) the slice is this mask.  A
        slice that drops query rows is refused: the parity core attends every row."""
        everything = slice(None)
        rows = index[2] if isinstance(index, tuple) and len(index) == 4 else None
        whole = (
            isinstance(rows, slice) and rows.start in (None, 0) and rows.stop is None and rows.step is None
        )
        if not whole or any(i != everything for i in (index[0], index[1], index[3])):
            raise NotImplementedError(
                f"cbgen.parity attends every query row; the model sliced its mask with {index!r} "
                "(call it with logits_to_keep=0)"
            )
        return self


def parity_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> ParityMask:
    """transformers' mask hook for the parity implementation (see the module docstring)."""
    if q_offset or kv_offset or q_length != kv_length:
        raise NotImplementedError(
            "cbgen.parity supports forwards over whole sequences, not decoding with a KV cache "
            "(call the model with use_cache=False or without past_key_values)"
        )
    extra = {"mask_function": mask_function} if mask_function is not None else {}
    full = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        use_vmap=bool(kwargs.get("use_vmap", False)),
        device=device,
        **extra,
    )
    if attention_mask is None:
        real = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    else:
        real = attention_mask.to(device=device, dtype=torch.bool)
    counts = real.sum(-1)
    first = real.int().argmax(-1)
    span = torch.arange(kv_length, device=device)
    contiguous = real == ((span >= first[:, None]) & (span < (first + counts)[:, None]))
    if not bool(contiguous.all()):
        raise NotImplementedError(
            "cbgen.parity takes rows padded on the left or the right: a row of this batch has padding between "
            "its tokens"
        )
    # Within a contiguous row the positions of two tokens differ as their indices do, so the mask
    # each row must have is the causal band over its real tokens (the window: the last local_size).
    hides = local_size is not None and bool((counts > local_size).any())
    band = torch.ones(kv_length, kv_length, dtype=torch.bool, device=device).tril()
    if hides:
        band = band.triu(-(local_size - 1))
    got = full.expand(batch_size, 1, q_length, kv_length)
    for lo in range(0, q_length, 512):  # query blocks: no [B, L, L] temporaries beside the mask
        hi = min(lo + 512, q_length)
        want = real[:, lo:hi, None] & real[:, None, :] & band[lo:hi]
        if not bool(((got[:, 0, lo:hi] == want) | ~real[:, lo:hi, None]).all()):
            raise NotImplementedError(
                "cbgen.parity computes causal attention over each row's own tokens (left or right padding, a "
                "sliding window): this forward's mask is another (packed sequences, position_ids that restart "
                "inside a row, a bidirectional or custom mask)"
            )
    rows = RowPositions.from_mask(real)
    return ParityMask(rows, local_size if hides else None)


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
    docstring); ``attention_mask`` is :func:`parity_mask`'s :class:`ParityMask` (visibility comes
    from its row positions), or None for a model that builds no mask (then the rows are taken as
    the parity context's pre-hook laid them out, or as unpadded)."""
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
    if isinstance(attention_mask, ParityMask):
        if attention_mask.window is not None and attention_mask.window != sliding_window:
            raise NotImplementedError(
                f"{type(module).__name__}'s mask hides keys past a window of {attention_mask.window} tokens "
                f"and its attention is given sliding_window={sliding_window}"
            )
        pos = attention_mask.rows.positions.to(query.device)
    elif attention_mask is not None:
        raise NotImplementedError(
            f"{type(module).__name__} gives attention a mask made outside transformers' mask functions, which "
            "cbgen.parity cannot check"
        )
    else:
        layout: RowPositions | None = kwargs.get("cbgen_parity")
        if layout is None:
            pos = torch.arange(length, device=query.device).expand(batch, length)
        else:
            pos = layout.positions.to(query.device)
    _check_position_ids(module, kwargs.get("position_ids"), pos)
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


def _check_position_ids(module: torch.nn.Module, position_ids, pos: torch.Tensor) -> None:
    """The rotary positions the model used must be each real token's position in its row (what the
    engine gives it), or the logits differ from the engine's however exact the attention is.  Once
    per forward (the first layer), where the model passes its ``position_ids`` on to attention."""
    if not isinstance(position_ids, torch.Tensor) or getattr(module, "layer_idx", 0) != 0:
        return
    ids = position_ids.to(pos.device).expand_as(pos)
    real = pos >= 0
    if not bool((ids[real] == pos[real]).all()):
        raise ValueError(
            "cbgen.parity: the forward's position_ids are not each token's position in its own row, as "
            "the engine numbers them: pass the padding mask as attention_mask (cbgen.parity then sets "
            "position_ids from it), or position_ids = mask.cumsum(-1) - 1 for real tokens"
        )


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
    """Registers :func:`parity_attention_forward` and :func:`parity_mask` with transformers
    (idempotent); returns their name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, parity_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, parity_mask)
        _registered = True
    return ATTN_NAME
