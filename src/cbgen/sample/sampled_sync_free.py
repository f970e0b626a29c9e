"""Sampled rows without a single device read-back (the sampler's ``sync_free=True``).

Every branch is decided on the host, from the requests.  Rows with truncation sort their whole
e-row once and derive top-k, top-p and min-p thresholds from it (work the read-back path avoids with
candidate lists and a widening ladder, which need read-backs to stop); rows that cannot be sampled
are sampled from a uniform stand-in and reported in ``bad``, read back later with the tokens.
"""

from __future__ import annotations

import torch

from cbgen.sample.batch_params import BatchParams
from cbgen.sample.inverse_cdf import inverse_cdf, inverse_cdf_blocked
from cbgen.sample.row_ops import NEG_INF, block_reduce, exp_sum, scatter_rows
from cbgen.sample.sampled import RowBatch, SampledRows, exp_pass, finish
from cbgen.sample.truncation import sorted_row_thresholds
from cbgen.sample.workspace import Workspace


def sample_rows_sync_free(
    ws: Workspace,
    generator: torch.Generator,
    raw: torch.Tensor,
    proc: torch.Tensor,
    params: BatchParams,
    rows: torch.Tensor | None,
    raw_shift: torch.Tensor,
    proc_max: torch.Tensor,
) -> SampledRows:
    """:func:`~cbgen.sample.sampled_readback.sample_rows_readback` without reading anything back;
    failed rows come back in ``bad`` instead of a ``failed`` dict."""
    dev = raw.device
    rows_list = params.sampled_rows
    unmodified_l = [not params.modified[r] for r in rows_list]
    want_plain = params.any_temperature and any(unmodified_l)
    b = exp_pass(ws, raw, proc, params, rows, raw_shift, proc_max, want_plain)
    _stand_in_bad_rows(b)
    b.u = b.sel(params.uniforms(generator, dev))
    mass_rows = _free_masses(b, unmodified_l)
    is_truncated = set(params.truncated_rows)
    truncated = [j for j, r in enumerate(rows_list) if r in is_truncated]
    if truncated:
        _sample_truncated(b, _local(truncated, dev))
    plain = [j for j, r in enumerate(rows_list) if r not in is_truncated]
    if plain:
        _sample_plain(ws, b, plain)
    return finish(b, flag_bad=True, mass_rows=mass_rows)


def _local(js: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(js, dtype=torch.int64).to(dev)


def _stand_in_bad_rows(b: RowBatch) -> None:
    """Gives rows with nothing to sample a uniform distribution, without reading ``bad`` back."""
    vocab = b.e.shape[1]
    bad = b.bad
    # A uniform stand-in keeps the batch math finite; the flag fails the request at read-back.
    b.e.masked_fill_(bad.unsqueeze(1), 1.0)
    ones_bsum = block_reduce(torch.ones(1, vocab, device=b.e.device), "sum")
    b.bsum = torch.where(bad.unsqueeze(1), ones_bsum, b.bsum)
    b.bmax = torch.where(bad.unsqueeze(1), torch.ones_like(b.bmax), b.bmax)
    b.total = torch.where(bad, torch.full_like(b.total, float(vocab)), b.total)
    b.shift = torch.where(bad, torch.zeros_like(b.shift), b.shift)


def _free_masses(b: RowBatch, unmodified_l: list[bool]) -> list[int]:
    """Sets ``b.mass`` where the raw normaliser came for free and returns those local rows."""
    # It does where the processed e-values are exp(raw - raw_max) (identity rows) or where
    # exp_rows summed the raw values on the way (unmodified rows).
    params, plain_sum = b.params, b.plain_sum
    n = len(unmodified_l)
    dev = b.e.device
    identity_l = [params.identity[r] for r in params.sampled_rows]
    mass_rows = [j for j in range(n) if identity_l[j] or (plain_sum is not None and unmodified_l[j])]
    b.mass = torch.full_like(b.total, float("nan"))
    if mass_rows:
        b.mass = torch.where(torch.tensor(identity_l).to(dev), b.total, b.mass)
        if plain_sum is not None:
            from_plain = [unmodified_l[j] and not identity_l[j] for j in range(n)]
            b.mass = torch.where(torch.tensor(from_plain).to(dev), plain_sum, b.mass)
    return mass_rows


def _sample_truncated(b: RowBatch, t: torch.Tensor) -> None:
    """Local rows ``t`` (those with top-k/top-p/min-p): whole sorted rows, thresholds, a draw."""
    params = b.params
    vals, ids = torch.sort(b.e.index_select(0, t), dim=1, descending=True)
    top_k, top_p, min_p = b.sel(params.top_k)[t], b.sel(params.top_p)[t], b.sel(params.min_p)[t]
    tau_t = sorted_row_thresholds(vals, top_k, top_p, min_p)
    b.tau[t] = tau_t
    weights = vals.double() * (vals >= tau_t.unsqueeze(1))
    j = inverse_cdf(weights, b.u.index_select(0, t))
    b.token[t] = ids.gather(1, j.unsqueeze(1)).squeeze(1)
    b.total[t] = weights.sum(1)
    g = b.glob.index_select(0, t)
    raw_vals = b.raw.index_select(0, g).gather(1, ids).double()
    raw_vals = raw_vals - b.raw_shift.index_select(0, g).double().unsqueeze(1)
    b.kept[t] = (torch.exp(raw_vals) * (weights > 0)).sum(1)


def _sample_plain(ws: Workspace, b: RowBatch, plain: list[int]) -> None:
    """Local rows ``plain`` (no truncation): a two-level draw over the whole e-row."""
    params = b.params
    n = len(params.sampled_rows)
    dev = b.e.device
    p = None if len(plain) == n else _local(plain, dev)
    bs = b.bsum if p is None else b.bsum.index_select(0, p)
    up = b.u if p is None else b.u.index_select(0, p)
    scatter_rows(b.token, p, inverse_cdf_blocked(b.e, p, bs, up))
    masked = [j for j in plain if params.masked[params.sampled_rows[j]]]
    if masked:
        m = _local(masked, dev)
        g = b.glob.index_select(0, m)
        b.kept[m] = exp_sum(
            b.raw,
            g,
            b.raw_shift.index_select(0, g),
            ws.scratch(len(masked), b.e.shape[1], dev),
            keep=b.proc,
            keep_rows=g,
            keep_above=NEG_INF,
        )


__all__ = ["sample_rows_sync_free"]
