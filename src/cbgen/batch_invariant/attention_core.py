"""The one attention computation both sides of parity mode run: each query reduces over its keys in
fixed blocks of absolute key positions, in order, whatever else shares the call.

For a query at position ``p`` the result depends only on its own vector, the keys and values at
positions ``0..p`` and the settings, not on how many queries or sequences are computed together,
how far the key tensor is padded, or whether the keys came from a paged cache or from the same
forward:

* scores are an elementwise product summed over ``head_dim`` (a reduction whose order is set by
  ``head_dim`` alone), not a matmul whose kernel depends on the shapes;
* the row maximum is exact whatever the order; ``exp`` goes through whole vectors only (the
  parity dispatch mode, :mod:`cbgen.batch_invariant.lanes`); hidden keys give exactly 0;
* sums over keys (the normaliser and ``p @ v``) are taken inside blocks of :data:`BLOCK` absolute
  positions (a fixed-length reduction), then over blocks in order (``cumsum``, sequential).  Blocks
  past a query's last visible key add exact zeros, so padding changes nothing.

Computed in float32 from the inputs' values (bfloat16 keys and values as they are in the cache).
Must run inside :class:`cbgen.batch_invariant.dispatch.ParityOps` (both sides do).
"""

from __future__ import annotations

import torch

BLOCK = 64
# Bound on the elements of the [G, n, H, S, D] products, so long sequences run in query chunks.
_MAX_PRODUCT = 1 << 23


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention ``[G, N, H, D]`` (``q``'s dtype) of queries ``q [G, N, H, D]`` at absolute positions
    ``q_pos [G, N]`` (-1: a padding row, output 0) over keys and values ``[G, S, Hkv, D]`` whose index
    is their position.  Causal; with ``sliding_window`` ``w`` a query at ``p`` sees keys ``> p - w``;
    ``softcap`` ``c`` maps scores to ``c * tanh(s / c)``.  Heads share keys in groups (GQA)."""
    groups, num_q, heads, dim = q.shape
    kh = _blocked_heads(k, heads)
    # [G, 1, H, nb, D, BLOCK]: keys last, so each block's sum in p @ v is a fixed-length inner reduction.
    vt = _blocked_heads(v, heads).transpose(-1, -2).contiguous()[:, None]
    per_query = groups * heads * kh.shape[2] * kh.shape[3] * dim
    step = max(1, min(num_q, BLOCK, _MAX_PRODUCT // max(per_query, 1)))
    outs = []
    for i in range(0, num_q, step):
        pos = q_pos[:, i : i + step]
        # Blocks past the chunk's last query hold only hidden keys (exact zeros): left out.
        need = min(max(int(pos.max()) // BLOCK + 1, 1), kh.shape[2])
        chunk = q[:, i : i + step]
        outs.append(_attend(chunk, kh[:, :, :need], vt[:, :, :, :need], pos, scale, sliding_window, softcap))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(q.dtype)


def _blocked_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[G, S, Hkv, D]`` -> float32 ``[G, H, nb, BLOCK, D]``, zero-padded to whole blocks, each query
    head with its key/value head."""
    groups, length, kv_heads, dim = x.shape
    padded = max(-(-length // BLOCK), 1) * BLOCK
    buf = x.new_zeros(groups, padded, kv_heads, dim, dtype=torch.float32)
    buf[:, :length] = x
    if heads != kv_heads:
        buf = buf.repeat_interleave(heads // kv_heads, dim=2)
    return buf.transpose(1, 2).reshape(groups, heads, padded // BLOCK, BLOCK, dim)


def _visible(q_pos: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[G, n, 1, S]``: key ``j`` visible to a query at ``p`` (``j <= p``, inside the window)."""
    j = torch.arange(num_keys, device=q_pos.device)
    p = q_pos[:, :, None, None]
    vis = j <= p
    if sliding_window is not None:
        vis = vis & (j > p - sliding_window)
    return vis


def _attend(
    q: torch.Tensor,
    kh: torch.Tensor,
    vt: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    groups, n, heads, dim = q.shape
    nb = kh.shape[2]
    keys = kh.reshape(groups, 1, heads, nb * BLOCK, dim)
    scores = (q.float().contiguous()[:, :, :, None, :] * keys).sum(-1) * scale  # [G, n, H, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~_visible(q_pos, nb * BLOCK, sliding_window), float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top).view(groups, n, heads, nb, BLOCK)
    norm = e.sum(-1).cumsum(-1)[..., -1]  # [G, n, H]
    acc = (e[:, :, :, :, None, :] * vt).sum(-1)  # [G, n, H, nb, D]
    acc = acc.transpose(-1, -2).contiguous().cumsum(-1)[..., -1]  # [G, n, H, D]
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return acc / safe[..., None]
