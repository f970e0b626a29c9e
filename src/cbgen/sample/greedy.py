"""Greedy rows: the argmax of the stage-1 logits, and the one-kernel shortcut for plain batches
(the kernel is the execution plan's choice, handed to the sampler: :mod:`cbgen.model.plan`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cbgen.sample.batch_params import BatchParams
from cbgen.sample.row_ops import logsumexp_rows, row_argmax, row_subset, scatter_rows, topk_desc
from cbgen.sample.sampler_output import FLAG_BAD_LOGITS, FLAG_NOTHING_CHOOSABLE, FLAG_OK, SamplerOutput


def sample_greedy_rows(
    proc: torch.Tensor,
    proc_bmax: torch.Tensor,
    params: BatchParams,
    raw_lse: torch.Tensor,
    token: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_lp: torch.Tensor | None,
) -> None:
    """Argmax of each greedy row of ``proc`` into ``token``, and their top logprobs where asked.

    Greedy top logprobs are ``log_softmax`` of the stage-1 logits at temperature 1: ``raw_lse`` (the
    raw normaliser) serves the rows stage 0/1 left unmodified.
    """
    num_rows = proc.shape[0]
    dev = proc.device
    rows = row_subset(params.greedy_rows, num_rows, dev)
    scatter_rows(token, rows, row_argmax(proc, rows, proc_bmax))
    if topk_ids is None or topk_lp is None:
        return
    wanted = set(params.logprob_rows)
    local = [j for j, r in enumerate(params.greedy_rows) if r in wanted]
    if not local:
        return
    lr = torch.tensor(local, dtype=torch.int64, device=dev)
    g = lr if rows is None else rows.index_select(0, lr)
    vals, ids = topk_desc(proc, topk_ids.shape[1], g, proc_bmax)
    # Which rows were modified is known on the host: no device read-back needed to pick them.
    mod_local = [k for k, j in enumerate(local) if params.modified[params.greedy_rows[j]]]
    lse = raw_lse.index_select(0, g)
    if mod_local:
        mod = torch.tensor(mod_local, dtype=torch.int64, device=dev)
        lse[mod] = logsumexp_rows(proc.index_select(0, g.index_select(0, mod)))
    topk_ids[g] = ids
    topk_lp[g] = (vals.double() - lse.unsqueeze(1)).float()


# The C greedy kernel (``cbgen.model.kernels.cpu.ops.greedy_rows``) as the execution plan hands it
# to the sampler: logits ``[B, V]`` -> (argmax int64, maximum float32, log-sum-exp float64) per row.
GreedyKernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def kernel_takes(raw: torch.Tensor) -> bool:
    """Whether ``raw`` has the layout the greedy kernel reads: float32 or bfloat16 rows on the CPU
    with unit column stride.  The plan hands the kernel to a sampler for its model's logits; this
    guards a caller passing other logits, which take the general path."""
    return raw.device.type == "cpu" and raw.dtype in (torch.float32, torch.bfloat16) and raw.stride(1) == 1


def greedy_by_kernel(raw: torch.Tensor, kernel: GreedyKernel) -> SamplerOutput:
    """A batch of unmodified greedy rows without top logprobs, in one kernel call (two reads of the
    logits instead of the general path's several passes); same outputs and failure flags."""
    token, top, lse = kernel(raw)
    raw_lp = (top.double() - lse).float()
    ok = torch.full_like(token, FLAG_OK, dtype=torch.int8)
    flags = torch.where(torch.isfinite(lse), ok, torch.full_like(ok, FLAG_BAD_LOGITS))
    flags = torch.where(torch.isfinite(top), flags, torch.full_like(ok, FLAG_NOTHING_CHOOSABLE))
    return SamplerOutput(
        token_ids=token,
        logprobs=torch.zeros_like(raw_lp),
        raw_logprobs=raw_lp,
        log_kept_mass=raw_lp.clone(),
        row_flags=flags,
        device_token_ids=token,
        kept_counts=torch.ones_like(token),
        kept_thresholds=top.float(),
    )


__all__ = ["GreedyKernel", "greedy_by_kernel", "kernel_takes", "sample_greedy_rows"]
