"""Sampled rows, branching on values read back from the device (the sampler's ``sync_free=False``).

Which rows a truncation cuts, whether a row's survivors fit its sorted candidate list and which rows
failed are decided from read-backs, so each row does only the work it needs: the cheapest algorithm
where a read-back costs nothing (the CPU).  Truncated rows whose survivors all sit in the candidate
list sample from that list; the rest (ties or a wide nucleus spilling past it) mask their whole row
and sample it in vocabulary order.
"""

from __future__ import annotations

import torch

from cbgen.sample.batch_params import BatchParams
from cbgen.sample.inverse_cdf import inverse_cdf, inverse_cdf_blocked
from cbgen.sample.row_ops import NEG_INF, block_reduce, exp_sum
from cbgen.sample.sampled import RowBatch, SampledRows, exp_pass, finish
from cbgen.sample.truncation import Truncation, truncation_thresholds
from cbgen.sample.workspace import Workspace


def sample_rows_readback(
    ws: Workspace,
    generator: torch.Generator,
    raw: torch.Tensor,
    proc: torch.Tensor,
    params: BatchParams,
    rows: torch.Tensor | None,
    raw_shift: torch.Tensor,
    proc_max: torch.Tensor,
    failed: dict[int, str],
) -> SampledRows:
    """Samples the rows ``params.sampled_rows`` (``rows`` on the device, ``None``: all) of ``proc``.

    ``raw_shift`` and ``proc_max`` are every batch row's raw and processed maxima; ``generator``
    draws the unseeded rows' uniforms.  Rows with nothing to sample are reported in ``failed``.
    """
    dev = raw.device
    rows_list = params.sampled_rows
    unmodified = torch.tensor([not params.modified[r] for r in rows_list], dtype=torch.bool, device=dev)
    # Rows that are raw logits at a temperature other than 1 get their raw normaliser on the way.
    want_plain = params.any_temperature and bool(unmodified.any())
    b = exp_pass(ws, raw, proc, params, rows, raw_shift, proc_max, want_plain)
    _fail_bad_rows(b, failed)
    b.u = b.sel(params.uniforms(generator, dev))
    # Rows whose processed e-values are exactly exp(raw - raw_max): their sum is the raw normaliser.
    identity = torch.tensor([params.identity[r] for r in rows_list], dtype=torch.bool, device=dev)
    nan = torch.full_like(b.total, float("nan"))
    b.mass = torch.where(identity & ~b.bad, b.total, nan)
    if b.plain_sum is not None:
        b.mass = torch.where(unmodified & ~identity & ~b.bad, b.plain_sum, b.mass)
    plain = torch.ones(len(rows_list), dtype=torch.bool, device=dev)
    if params.any_truncation:
        _sample_truncated(ws, b, identity, plain)
    _sample_plain(ws, b, plain)
    return finish(b)


def _fail_bad_rows(b: RowBatch, failed: dict[int, str]) -> None:
    """Reports rows with nothing to sample and gives them a harmless uniform distribution."""
    if not bool(b.bad.any()):
        return
    bad = b.bad.nonzero().squeeze(1)
    for j in bad.tolist():
        failed[b.params.sampled_rows[j]] = (
            "no token can be sampled: every logit is -inf or the logits hold NaN/inf"
        )
    # The stand-in keeps the batch math finite.
    b.e[bad] = 1.0
    b.bsum[bad] = block_reduce(b.e[bad], "sum")
    b.bmax[bad] = 1.0
    b.total[bad] = float(b.e.shape[1])
    b.shift = torch.where(b.bad, torch.zeros_like(b.shift), b.shift)


def _sample_truncated(ws: Workspace, b: RowBatch, identity: torch.Tensor, plain: torch.Tensor) -> None:
    """Rows with top-k/top-p/min-p: thresholds, then a draw from the survivors; clears their
    ``plain`` entry where the truncation cuts anything."""
    params = b.params
    top_k, top_p, min_p = b.sel(params.top_k), b.sel(params.top_p), b.sel(params.min_p)
    t_rows = ((top_k > 0) | (top_p < 1.0) | (min_p > 0)).nonzero().squeeze(1)
    if not t_rows.numel():
        return
    tr = truncation_thresholds(
        b.e,
        t_rows,
        b.total.index_select(0, t_rows),
        top_k.index_select(0, t_rows),
        top_p.index_select(0, t_rows),
        min_p.index_select(0, t_rows),
        b.bmax,
    )
    b.tau[t_rows] = tr.tau
    cuts = tr.tau > 0
    plain[t_rows] = ~cuts
    # Survivors all in the sorted candidate list: sample from the list alone.
    pos = (cuts & tr.complete).nonzero().squeeze(1)
    if pos.numel():
        _sample_listed(b, t_rows, tr, pos)
    # Survivors spill past the list (ties or a wide nucleus): mask whole rows.
    pos = (cuts & ~tr.complete).nonzero().squeeze(1)
    if pos.numel():
        _sample_spilled(ws, b, t_rows.index_select(0, pos), identity)


def _sample_listed(b: RowBatch, t_rows: torch.Tensor, tr: Truncation, pos: torch.Tensor) -> None:
    """Truncated rows ``t_rows[pos]`` whose survivors all sit in their candidate list."""
    loc = t_rows.index_select(0, pos)
    vals = tr.values.index_select(0, pos)
    ids = tr.ids.index_select(0, pos)
    weights = vals.double() * (vals >= tr.tau.index_select(0, pos).unsqueeze(1))
    j = inverse_cdf(weights, b.u.index_select(0, loc))
    b.token[loc] = ids.gather(1, j.unsqueeze(1)).squeeze(1)
    b.total[loc] = weights.sum(1)
    g = b.glob.index_select(0, loc)
    raw_vals = b.raw[g.unsqueeze(1), ids].double() - b.raw_shift.index_select(0, g).double().unsqueeze(1)
    b.kept[loc] = (torch.exp(raw_vals) * (weights > 0)).sum(1)


def _sample_spilled(ws: Workspace, b: RowBatch, loc: torch.Tensor, identity: torch.Tensor) -> None:
    """Truncated rows ``loc`` whose survivors do not fit the candidate list: masked whole rows."""
    vocab = b.e.shape[1]
    dev = b.e.device
    w = ws.buffer("masked", loc.numel(), vocab, dev)
    torch.index_select(b.e, 0, loc, out=w)
    w.mul_(w >= b.tau.index_select(0, loc).unsqueeze(1))
    wsum = block_reduce(w, "sum")
    b.token[loc] = inverse_cdf_blocked(w, None, wsum, b.u.index_select(0, loc))
    b.total[loc] = wsum.sum(1)
    ident = identity.index_select(0, loc)
    if bool(ident.all()):
        b.kept[loc] = b.total.index_select(0, loc)
    else:
        scratch = ws.scratch(loc.numel(), vocab, dev)
        g = b.glob.index_select(0, loc)
        b.kept[loc] = exp_sum(
            b.raw,
            g,
            b.raw_shift.index_select(0, g),
            scratch,
            keep=w,
            keep_rows=None,
            keep_above=0.0,
        )


def _sample_plain(ws: Workspace, b: RowBatch, plain: torch.Tensor) -> None:
    """Rows no truncation cuts: a two-level draw over the whole e-row."""
    p_rows = plain.nonzero().squeeze(1)
    if not p_rows.numel():
        return
    vocab = b.e.shape[1]
    dev = b.e.device
    loc = None if p_rows.numel() == plain.shape[0] else p_rows
    bs = b.bsum if loc is None else b.bsum.index_select(0, p_rows)
    b.token[p_rows] = inverse_cdf_blocked(b.e, loc, bs, b.u.index_select(0, p_rows))
    masked_l = [b.params.masked[r] for r in b.params.sampled_rows]
    masked = torch.tensor(masked_l, dtype=torch.bool, device=dev)
    m_rows = (plain & masked & ~b.bad).nonzero().squeeze(1)
    if m_rows.numel():
        scratch = ws.scratch(m_rows.numel(), vocab, dev)
        g = b.glob.index_select(0, m_rows)
        b.kept[m_rows] = exp_sum(
            b.raw, g, b.raw_shift.index_select(0, g), scratch, keep=b.proc, keep_rows=g, keep_above=NEG_INF
        )


__all__ = ["sample_rows_readback"]
