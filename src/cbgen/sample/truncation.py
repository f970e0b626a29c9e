"""Top-k, top-p and min-p as one per-row survivor threshold in "e-space".

For a sampled row with processed logits ``x`` and temperature ``T`` the sampler materialises
``e = exp((x - max(x)) / T)``, so ``e`` lies in ``[0, 1]`` with exactly ``1`` at the argmax.  Top-k,
top-p and min-p then reduce to one per-row threshold ``tau``: the survivors are the tokens with
``e >= tau`` (ties with the cut-off value are kept, like the ``logits < kth_value`` rule of
``transformers``).  Min-p compares against the maximum probability, which is exactly ``e == 1``, so
its threshold is ``min_p`` itself.

:func:`truncation_thresholds` works from a short sorted candidate list and widens it only when a
row needs more (it reads values back to decide); :func:`sorted_row_thresholds` takes whole sorted
rows and never reads anything back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbgen.sample.row_ops import sort_values_desc, topk_desc

# Candidate list widths tried for top-p on accelerators before a full sort of the row (on CPU the
# numpy sort is cheap enough to go straight to it after the first width).
TOP_P_WIDTHS = (64, 1024, 8192)


@dataclass
class Truncation:
    """Result of :func:`truncation_thresholds` for a set of rows of the e-space tensor.

    ``tau``: survivors are ``e >= tau``.  ``values``/``ids``: the row's largest e-values (sorted
    descending) and their columns; ``complete``: whether that list holds every survivor, so the row
    can be sampled from the list alone.
    """

    tau: torch.Tensor
    values: torch.Tensor
    ids: torch.Tensor
    complete: torch.Tensor


def truncation_thresholds(
    e: torch.Tensor,
    rows: torch.Tensor,
    row_sums: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bmax: torch.Tensor | None = None,
) -> Truncation:
    """Per-row survivor threshold for top-k, then top-p, then min-p, each on the renormalised survivors.

    ``e`` is the e-space tensor (see the module docstring) and ``rows`` the rows to process;
    ``row_sums`` (float64) their full sums; ``top_k`` (0 = off), ``top_p`` (1 = off) and ``min_p``
    (0 = off) their settings.  Top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches ``top_p`` (a token is kept while the mass strictly before it is below ``top_p``).
    """
    vocab = e.shape[1]
    has_k = top_k > 0
    kmax = int(top_k.max()) if bool(has_k.any()) else 0
    width = min(vocab, max(kmax, TOP_P_WIDTHS[0]) + 1)
    values, ids = topk_desc(e, width, rows, bmax)
    kth = values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    tau = torch.where(has_k, kth, torch.zeros_like(kth))
    need_p = top_p < 1.0
    if bool(need_p.any()):
        p_local = need_p.nonzero().squeeze(1)
        tau_k = tau.index_select(0, p_local)
        k_rows = has_k.index_select(0, p_local)
        vals_p = values.index_select(0, p_local)
        # Mass left after top-k: the full sum, or the listed survivors if the list holds all of
        # them, or (ties running past the list) a masked sum over the row.
        listed_all = (width == vocab) | (vals_p[:, -1] < tau_k)
        masked_vals = vals_p.double() * (vals_p >= tau_k.unsqueeze(1))
        mass = torch.where(k_rows & listed_all, masked_vals.sum(1), row_sums.index_select(0, p_local))
        tie_rows = (k_rows & ~listed_all).nonzero().squeeze(1)
        if tie_rows.numel():
            sub = e.index_select(0, rows.index_select(0, p_local.index_select(0, tie_rows)))
            thr = tau_k.index_select(0, tie_rows).unsqueeze(1)
            mass[tie_rows] = (sub.double() * (sub >= thr)).sum(1)
        tau_p = _top_p_cutoff(
            e, rows.index_select(0, p_local), vals_p, tau_k, mass, top_p.index_select(0, p_local), bmax
        )
        tau[p_local] = torch.maximum(tau_k, tau_p)
    tau = torch.maximum(tau, min_p)
    complete = (values[:, -1] < tau) if width < vocab else torch.ones_like(has_k)
    return Truncation(tau=tau, values=values, ids=ids, complete=complete)


def _top_p_cutoff(
    e: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    tau_k: torch.Tensor,
    mass: torch.Tensor,
    top_p: torch.Tensor,
    bmax: torch.Tensor | None,
) -> torch.Tensor:
    """The e-value of the last token top-p keeps, widening the sorted candidate list until it decides."""
    vocab = e.shape[1]
    out = torch.empty_like(tau_k)
    pending = torch.arange(rows.numel(), device=e.device)
    # On CPU a full sort (numpy) is cheaper than widening through large top-k calls.
    ladder = TOP_P_WIDTHS if e.device.type != "cpu" else ()
    widths = [w for w in ladder if w + 1 > values.shape[1]] + [vocab]
    while True:
        width = values.shape[1]
        thr = tau_k.index_select(0, pending).unsqueeze(1)
        w = values.double() * (values >= thr)
        cum = w.cumsum(1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        target = (top_p.index_select(0, pending) * mass.index_select(0, pending)).unsqueeze(1)
        n_keep = (before < target).sum(1)
        # Decided when the first dropped position is inside the list, or the list is the whole row.
        done = (n_keep < width) | (width >= vocab)
        if bool(done.any()):
            d = done.nonzero().squeeze(1)
            last = values.index_select(0, d).gather(1, (n_keep.index_select(0, d) - 1).unsqueeze(1))
            out[pending.index_select(0, d)] = last.squeeze(1)
        pending = pending[~done]
        if pending.numel() == 0:
            return out
        next_width = min(widths.pop(0) + 1, vocab)
        if next_width == vocab:
            values = sort_values_desc(e.index_select(0, rows.index_select(0, pending)))
        else:
            values, _ = topk_desc(e, next_width, rows.index_select(0, pending), bmax)


def sorted_row_thresholds(
    vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Survivor threshold of each row of ``vals`` (whole e-rows sorted descending), with the
    semantics of :func:`truncation_thresholds`, without a single read-back."""
    kth = vals.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    tau = torch.where(top_k > 0, kth, torch.zeros_like(kth))
    # Top-p on what top-k left: keep a token while the mass strictly before it is < top_p.
    w = vals.double() * (vals >= tau.unsqueeze(1))
    cum = w.cumsum(1)
    n_keep = ((cum - w) < (top_p * cum[:, -1]).unsqueeze(1)).sum(1)
    tau_p = vals.gather(1, (n_keep - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    tau = torch.where(top_p < 1.0, torch.maximum(tau, tau_p), tau)
    return torch.maximum(tau, min_p)


__all__ = ["TOP_P_WIDTHS", "Truncation", "sorted_row_thresholds", "truncation_thresholds"]
