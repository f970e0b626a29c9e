"""Inverse-CDF draws in float64 that can never pick a token of zero weight.

:func:`inverse_cdf` walks a short weight list (a row's sorted survivors); :func:`inverse_cdf_blocked`
walks whole rows in two levels, first over ``BLOCK``-wide block sums, then inside one block, so it
never materialises a float64 cumulative sum of a whole vocabulary.
"""

from __future__ import annotations

import torch

from cbgen.sample.row_ops import BLOCK, gather_blocks


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Index of the last strictly positive entry of each row (0 if none)."""
    width = weights.shape[1]
    return width - 1 - (weights > 0).flip(1).to(torch.int32).argmax(dim=1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index where ``cumsum(weights) > u * sum(weights)``, per row, in float64.

    A zero-weight entry can never be chosen: the cumulative sum does not rise there.  The
    ``u -> 1`` rounding edge falls back to the last positive entry.
    """
    w = weights.double()
    cum = w.cumsum(1)
    target = (u * cum[:, -1]).unsqueeze(1)
    j = torch.searchsorted(cum, target, right=True).squeeze(1)
    last = _last_positive(w)
    j = torch.where(j >= w.shape[1], last, j)
    ok = w.gather(1, j.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, j, last)


def inverse_cdf_blocked(
    w: torch.Tensor, rows: torch.Tensor | None, bsum: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sampling over whole rows of ``w`` (or its ``rows``) using precomputed block sums.

    First the block whose cumulative sum passes ``u * total`` (float64 over the block sums), then the
    position inside that block (float64 cumsum of its ``BLOCK`` entries).  Returns column ids.
    """
    nb = bsum.shape[1]
    cum = bsum.cumsum(1)
    target = u * cum[:, -1]
    b = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
    b = torch.where(b >= nb, _last_positive(bsum), b)
    before = torch.where(
        b > 0, cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(target)
    )
    inner_u = (target - before).clamp(min=0.0)
    vals, cols = gather_blocks(w, b.unsqueeze(1), 0.0, rows)
    inner = vals.double()
    icum = inner.cumsum(1)
    j = torch.searchsorted(icum, inner_u.unsqueeze(1), right=True).squeeze(1)
    last = _last_positive(inner)
    j = torch.where(j >= BLOCK, last, j)
    ok = inner.gather(1, j.clamp(max=inner.shape[1] - 1).unsqueeze(1)).squeeze(1) > 0
    j = torch.where(ok, j, last)
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


__all__ = ["inverse_cdf", "inverse_cdf_blocked"]
