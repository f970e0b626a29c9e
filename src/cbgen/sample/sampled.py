"""What both sampled-row algorithms share: the e-space pass, the per-step row state and the result.

The sampled (non-greedy) rows are processed in their local order: local row ``j`` is batch row
``params.sampled_rows[j]``, which ``glob[j]`` holds as a device index.  :func:`exp_pass` fills the
e-space rows (see :mod:`cbgen.sample.truncation`) and their block sums and maxima; the algorithms in
:mod:`cbgen.sample.sampled_readback` and :mod:`cbgen.sample.sampled_sync_free` then pick a token per
row and fill ``token``, ``total`` (sum of the surviving e-values), ``tau`` and ``kept``;
:func:`finish` turns that into logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbgen.sample.batch_params import BatchParams
from cbgen.sample.row_ops import NEG_INF, exp_rows, finite_or, topk_desc
from cbgen.sample.workspace import Workspace


@dataclass
class SampledRows:
    """Per-row results of the sampled (non-greedy) rows, in their local order."""

    token: torch.Tensor
    logprob: torch.Tensor  # float64
    kept: torch.Tensor  # float64 raw mass in units of exp(raw - raw_max); NaN means "everything"
    mass: torch.Tensor  # float64 sum of exp(raw - raw_max), NaN where not computed
    topk_rows: torch.Tensor | None = None  # local rows that asked for top logprobs
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # bool: rows with nothing to sample (sync-free path only)
    mass_rows: list[int] | None = None  # local rows whose ``mass`` is set (sync-free path only)
    kept_count: torch.Tensor | None = None  # int64: the kept set's size, 0 where nothing was cut
    kept_threshold: torch.Tensor | None = None  # float32: its smallest processed logit, -inf if uncut


@dataclass
class RowBatch:
    """The sampled rows of one step while they are being sampled (all tensors on the logits' device).

    ``rows`` selects them from the batch (``None``: every row, in order); ``raw``/``proc`` are the
    whole batch's raw and processed logits and ``raw_shift`` its raw row maxima.  ``e`` holds the
    e-values, ``shift`` the processed row maxima they are relative to, ``total`` their sums.
    """

    raw: torch.Tensor
    proc: torch.Tensor
    params: BatchParams
    rows: torch.Tensor | None
    glob: torch.Tensor
    raw_shift: torch.Tensor
    temperature: torch.Tensor
    proc_max: torch.Tensor
    shift: torch.Tensor
    e: torch.Tensor
    bsum: torch.Tensor  # float64 block sums of e
    bmax: torch.Tensor  # block maxima of e
    plain_sum: torch.Tensor | None  # float64 sums of exp(proc - shift) at temperature 1, if computed
    total: torch.Tensor  # float64
    bad: torch.Tensor  # bool: nothing can be sampled
    token: torch.Tensor
    kept: torch.Tensor
    tau: torch.Tensor
    u: torch.Tensor | None = None  # float64 uniforms
    mass: torch.Tensor | None = None

    def sel(self, t: torch.Tensor) -> torch.Tensor:
        """The sampled rows' entries of a per-batch-row tensor, on the device."""
        t = t.to(self.raw.device)
        return t if self.rows is None else t.index_select(0, self.rows)


def exp_pass(
    ws: Workspace,
    raw: torch.Tensor,
    proc: torch.Tensor,
    params: BatchParams,
    rows: torch.Tensor | None,
    raw_shift: torch.Tensor,
    proc_max: torch.Tensor,
    want_plain: bool,
) -> RowBatch:
    """Fills the e-space rows of the sampled rows and starts their :class:`RowBatch`.

    ``want_plain`` also sums ``exp(proc - shift)`` at temperature 1 on the way (see
    :func:`~cbgen.sample.row_ops.exp_rows`).
    """
    vocab = raw.shape[1]
    dev = raw.device
    n = len(params.sampled_rows)
    glob = torch.arange(n, device=dev) if rows is None else rows
    temperature = params.temperature.to(dev)
    temperature = temperature if rows is None else temperature.index_select(0, rows)
    proc_max = proc_max if rows is None else proc_max.index_select(0, rows)
    shift = finite_or(proc_max, 0.0)
    e = ws.buffer("e", n, vocab, dev)
    bsum, bmax, plain_sum = exp_rows(
        proc,
        rows,
        shift,
        temperature if params.any_temperature else None,
        e,
        scratch=ws.scratch(n, vocab, dev) if want_plain else None,
    )
    total = bsum.sum(1)
    bad = ~torch.isfinite(proc_max) | ~torch.isfinite(total) | (total <= 0)
    return RowBatch(
        raw=raw,
        proc=proc,
        params=params,
        rows=rows,
        glob=glob,
        raw_shift=raw_shift,
        temperature=temperature,
        proc_max=proc_max,
        shift=shift,
        e=e,
        bsum=bsum,
        bmax=bmax,
        plain_sum=plain_sum,
        total=total,
        bad=bad,
        token=torch.zeros(n, dtype=torch.int64, device=dev),
        kept=torch.full((n,), float("nan"), dtype=torch.float64, device=dev),
        tau=torch.zeros(n, dtype=torch.float32, device=dev),
    )


def finish(b: RowBatch, flag_bad: bool = False, mass_rows: list[int] | None = None) -> SampledRows:
    """The rows' processed logprobs and top logprobs, once ``token``, ``total`` and ``tau`` are set.

    ``flag_bad`` (sync-free) reports ``bad`` rows as flags and keeps their logprob finite.
    """
    x_tok = b.proc[b.glob, b.token].double()
    if flag_bad:
        x_tok = torch.where(b.bad, b.shift.double(), x_tok)
    temp64 = b.temperature.double()
    logprob = (x_tok - b.shift.double()) / temp64 - torch.log(b.total)
    res = SampledRows(
        token=b.token,
        logprob=logprob,
        kept=b.kept,
        mass=b.mass,
        bad=b.bad if flag_bad else None,
        mass_rows=mass_rows,
    )
    res.kept_count, res.kept_threshold = _kept_record(b, read_back=not flag_bad)
    _top_logprobs(res, b, temp64)
    return res


def _kept_record(b: RowBatch, read_back: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept set as a count and the smallest kept processed logit (see
    :class:`cbgen.sample.sampler_output.SamplerOutput`).  The survivors are ``e >= tau`` and ``e``
    grows with the processed logit, so they are exactly the tokens at or above that logit.  Only rows
    with a cut (``tau > 0``) pay a pass over the vocabulary; ``read_back`` picks them on the host."""
    n, dev = b.token.shape[0], b.e.device
    count = torch.zeros(n, dtype=torch.int64, device=dev)
    threshold = torch.full((n,), NEG_INF, dtype=torch.float32, device=dev)
    cut = b.tau > 0
    if read_back:
        rows = cut.nonzero().squeeze(1)
        if rows.numel() == 0:
            return count, threshold
    else:
        rows = torch.arange(n, device=dev)
    keep = b.e.index_select(0, rows) >= b.tau.index_select(0, rows).unsqueeze(1)
    x = b.proc.index_select(0, b.glob.index_select(0, rows))
    low = torch.where(keep, x, torch.full_like(x, float("inf"))).amin(1)
    sel = cut.index_select(0, rows)
    count[rows] = torch.where(sel, keep.sum(1), count.index_select(0, rows))
    threshold[rows] = torch.where(sel, low, threshold.index_select(0, rows))
    return count, threshold


def _top_logprobs(res: SampledRows, b: RowBatch, temp64: torch.Tensor) -> None:
    """Fills ``res.topk_*`` for the sampled rows that asked: processed logprobs, ``-inf`` if cut."""
    params = b.params
    if params.num_top_logprobs <= 0:
        return
    wanted = set(params.logprob_rows)
    local = [j for j, r in enumerate(params.sampled_rows) if r in wanted]
    if not local:
        return
    lr = torch.tensor(local, dtype=torch.int64, device=b.e.device)
    vals, ids = topk_desc(b.e, params.num_top_logprobs, lr, b.bmax)
    g = b.glob.index_select(0, lr)
    x = b.proc[g.unsqueeze(1), ids].double()
    lp = (x - b.shift.index_select(0, lr).double().unsqueeze(1)) / temp64.index_select(0, lr).unsqueeze(1)
    lp = lp - torch.log(b.total.index_select(0, lr)).unsqueeze(1)
    survives = vals >= b.tau.index_select(0, lr).unsqueeze(1)
    res.topk_rows = lr
    res.topk_ids = ids
    res.topk_logprobs = torch.where(survives, lp, torch.full_like(lp, NEG_INF))


__all__ = ["RowBatch", "SampledRows", "exp_pass", "finish"]
