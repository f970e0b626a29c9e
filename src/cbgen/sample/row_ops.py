"""Vectorised row kernels over ``[R, V]`` float tensors: exp passes, block reductions, argmax, top-k.

Several helpers prune by fixed-width column blocks: the top-``k`` values of a row all lie in the
``k`` blocks with the largest block maxima, so ``topk`` only has to look at ``k * BLOCK``
columns, and a row's argmax is found from block maxima plus one block.  On CPUs those
reductions are several times cheaper than the dense kernels they replace.
"""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")
# float32 exp() of arguments below about -87 yields subnormals, which on x86 runs 50-100x slower
# (microcode assists) and is routine here: logits 30 below the max at temperature 0.3.  safe_exp_
# clamps there and subtracts exp(floor), so those entries become exactly 0 and every result above
# ~1e-31 is bit-identical to exp().
_EXP_FLOOR = -87.0
_EXP_FLOOR_VALUE = float(torch.exp(torch.tensor(_EXP_FLOOR, dtype=torch.float32)))
# Width of the column blocks used for pruned top-k, block argmax and two-level inverse-CDF sampling.
BLOCK = 64
# Rows per chunk for the dense exp passes on CPU: small enough that the chunk stays in cache
# between the subtract, divide, exp and reduce passes (16 rows of a 49k vocabulary), and no smaller,
# because with a small vocabulary each chunk's handful of ops costs more than its math.
CPU_CHUNK_ELEMS = 16 * 49152
# The CPU shortcut in safe_exp_ reads a value back; tests turn it off to check the device path on CPU.
CPU_EXP_SHORTCUT = True


def cpu_chunk_rows(vocab: int) -> int:
    """Rows per chunk of the CPU exp passes for a vocabulary of ``vocab`` columns."""
    return max(1, CPU_CHUNK_ELEMS // max(vocab, 1))


def safe_exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``exp`` of a float32 tensor of non-positive values, flushing results below ~1.6e-38 to 0."""
    # On CPU one min-reduction is cheaper than the clamp and subtract it lets us skip; elsewhere
    # avoid the host sync.
    if CPU_EXP_SHORTCUT and x.device.type == "cpu" and x.numel() and bool(x.amin() >= _EXP_FLOOR):
        return x.exp_()
    return x.clamp_(min=_EXP_FLOOR).exp_().sub_(_EXP_FLOOR_VALUE)


def block_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """Per-block ``"max"`` or ``"sum"`` over ``BLOCK``-wide column blocks of a 2-D tensor.

    The last block may be narrower.  Sums are returned in float64 (accumulated in float32 inside
    a block; the relative error, ~1e-7, is far below float32 input precision).
    """
    vocab = x.shape[1]
    full = vocab // BLOCK
    parts = []
    if full:
        main = x[:, : full * BLOCK].unflatten(1, (full, BLOCK))
        parts.append(main.amax(-1) if op == "max" else main.sum(-1))
    if vocab % BLOCK:
        tail = x[:, full * BLOCK :]
        parts.append(tail.amax(-1, keepdim=True) if op == "max" else tail.sum(-1, keepdim=True))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.double() if op == "sum" else out


def gather_blocks(
    x: torch.Tensor, blocks: torch.Tensor, fill: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and column ids of the selected blocks: ``blocks`` is ``[R, n]`` block ids per row.

    Columns past the end of the vocabulary (the short last block) read as ``fill``; their ids are
    clamped into range so they are always valid indices.
    """
    vocab = x.shape[1]
    cols = (blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    valid = None
    if vocab % BLOCK:
        valid = cols < vocab
        cols = cols.clamp_max(vocab - 1)
    if rows is None:
        vals = x.gather(1, cols)
    elif x.is_contiguous():
        # A flat index_select is much cheaper than 2-D advanced indexing on CPU.
        flat = (rows * vocab).unsqueeze(1) + cols
        vals = x.view(-1).index_select(0, flat.view(-1)).view(flat.shape)
    else:
        vals = x[rows.unsqueeze(1), cols]
    if valid is not None:
        vals = vals.masked_fill(~valid, fill)
    return vals, cols


def sort_values_desc(x: torch.Tensor) -> torch.Tensor:
    """Each row's values sorted in descending order (no indices)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # numpy's SIMD sort is ~25x faster than torch's CPU sort, which also always builds indices.
        return torch.from_numpy(-np.sort(-x.numpy(), axis=1))
    return torch.sort(x, dim=1, descending=True).values


def row_argmax(
    x: torch.Tensor, rows: torch.Tensor | None = None, bmax: torch.Tensor | None = None
) -> torch.Tensor:
    """First index of each row's (or ``rows``') maximum, like ``torch.argmax`` (NaN counts as the maximum).

    ``bmax`` may pass precomputed block maxima of all rows of ``x``.
    """
    if bmax is None:
        bmax = block_reduce(x if rows is None else x.index_select(0, rows), "max")
    elif rows is not None:
        bmax = bmax.index_select(0, rows)
    best = bmax.argmax(dim=1, keepdim=True)
    vals, cols = gather_blocks(x, best, NEG_INF, rows)
    return cols.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)


def topk_desc(
    x: torch.Tensor, k: int, rows: torch.Tensor | None = None, bmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` values (sorted descending) and their column ids for each row (or ``rows`` subset).

    The returned multiset of values is exact; among equal values the ids are arbitrary.
    ``bmax`` may pass precomputed block maxima of all rows of ``x``.
    """
    vocab = x.shape[1]
    k = min(k, vocab)
    if 2 * k * BLOCK > vocab:
        sub = x if rows is None else x.index_select(0, rows)
        if k == vocab:
            return torch.sort(sub, dim=1, descending=True)
        return torch.topk(sub, k, dim=1)
    if bmax is None:
        bmax = block_reduce(x if rows is None else x.index_select(0, rows), "max")
    elif rows is not None:
        bmax = bmax.index_select(0, rows)
    # Any value in the row's top-k lies in one of the k blocks with the largest maxima (if it sat in
    # another block, those k blocks would each hold a value at least as large: k+1 in all).
    blocks = torch.topk(bmax, k, dim=1).indices
    vals, cols = gather_blocks(x, blocks, NEG_INF, rows)
    top, pos = torch.topk(vals, k, dim=1)
    return top, cols.gather(1, pos)


def exp_rows(
    src: torch.Tensor,
    rows: torch.Tensor | None,
    shift: torch.Tensor,
    temperature: torch.Tensor | None,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``out = exp((src[rows] - shift) / temperature)`` row-wise, plus block sums and block maxima.

    Returns ``(block_sums float64 [R, nb], block_max [R, nb], shifted_sums float64 [R] or None)``.
    With a ``scratch`` buffer (and a temperature) it also returns ``sum(exp(src[rows] - shift))``,
    computed while the chunk is in cache: for rows whose processed logits are the raw ones this is
    the raw softmax normaliser, which saves a second pass over the raw logits.  On CPU the rows are
    processed in small chunks so all passes over a chunk hit cache.
    """
    n = out.shape[0]
    step = cpu_chunk_rows(out.shape[1]) if out.device.type == "cpu" else max(n, 1)
    sums = []
    maxes = []
    plain_sums = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        o = out[start:stop]
        if rows is None:
            torch.sub(src[start:stop], shift[start:stop, None], out=o)
        else:
            torch.index_select(src, 0, rows[start:stop], out=o)
            o.sub_(shift[start:stop, None])
        if temperature is not None:
            if scratch is not None:
                t = scratch[: stop - start]
                safe_exp_(t.copy_(o))
                plain_sums.append(block_reduce(t, "sum").sum(1))
            o.div_(temperature[start:stop, None])
        safe_exp_(o)
        sums.append(block_reduce(o, "sum"))
        maxes.append(block_reduce(o, "max"))
    bsum = torch.cat(sums) if len(sums) != 1 else sums[0]
    bmax = torch.cat(maxes) if len(maxes) != 1 else maxes[0]
    return bsum, bmax, (torch.cat(plain_sums) if plain_sums else None)


def exp_sum(
    src: torch.Tensor,
    rows: torch.Tensor | None,
    shift: torch.Tensor,
    scratch: torch.Tensor,
    keep: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
    keep_above: float = 0.0,
) -> torch.Tensor:
    """``sum(exp(src[rows] - shift))`` per row in float64.

    With ``keep``, only entries where ``keep[keep_rows] > keep_above`` count (``keep_rows=None``:
    ``keep`` is aligned with the output rows).  ``scratch`` is a float32 buffer whose row count sets
    the chunk size.
    """
    n = shift.shape[0]
    step = max(scratch.shape[0], 1)
    out = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        o = scratch[: stop - start]
        if rows is None:
            torch.sub(src[start:stop], shift[start:stop, None], out=o)
        else:
            torch.index_select(src, 0, rows[start:stop], out=o)
            o.sub_(shift[start:stop, None])
        safe_exp_(o)
        if keep is not None:
            k = keep[start:stop] if keep_rows is None else keep.index_select(0, keep_rows[start:stop])
            o.mul_(k > keep_above)
        # Float32 sums inside 64-wide blocks, float64 across them: accurate, and no float64 copy of the chunk.
        out.append(block_reduce(o, "sum").sum(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=src.device)


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp in float64 (``-inf`` for an all ``-inf`` row)."""
    m = x.amax(dim=1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = block_reduce(safe_exp_(x.float() - safe.unsqueeze(1).float()), "sum").sum(1)
    return safe.double() + torch.log(s)


def finite_or(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with non-finite entries replaced by ``value``."""
    return torch.where(torch.isfinite(x), x, torch.full_like(x, value))


def row_subset(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """``rows`` as a device index, or ``None`` when it is every row in order."""
    # None lets the math skip gathers entirely.
    return None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.int64, device=device)


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    """``dst[rows] = values`` (``rows=None``: every row)."""
    if rows is None:
        dst.copy_(values)
    else:
        dst[rows] = values.to(dst.dtype)


__all__ = [
    "BLOCK",
    "NEG_INF",
    "block_reduce",
    "cpu_chunk_rows",
    "exp_rows",
    "exp_sum",
    "finite_or",
    "gather_blocks",
    "logsumexp_rows",
    "row_argmax",
    "row_subset",
    "safe_exp_",
    "scatter_rows",
    "sort_values_desc",
    "topk_desc",
]
