"""Logprobs of prompt tokens: raw (temperature 1) log-probabilities from the prefill's logits rows.

In parity mode every value, the prompt token's and each candidate's, is the trainer side's
:func:`cbgen.batch_invariant.logprobs.token_logprobs` of its row, so it equals what the trainer's
parity forward gives that token bit for bit (as generated tokens' ``raw_logprobs`` do)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cbgen.batch_invariant.logprobs import token_logprobs
from cbgen.sample.row_ops import logsumexp_rows, topk_desc

if TYPE_CHECKING:
    from cbgen.model.input_batch import PromptLogprobRows


def prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int, parity: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw (temperature 1) log-probabilities of ``target_ids`` under each row of ``logits``.

    Returns ``(logprobs [N] float32, topk_ids [N, k] int64 or None, topk_logprobs [N, k] float32 or
    None)`` on the CPU; the top-k parts are ``None`` when ``k == 0``.  Row ``i`` of ``logits`` is the
    prediction for ``target_ids[i]`` (so for a prompt, logits of positions ``0..L-2`` and targets
    ``prompt[1:]``).  ``parity``: every value through the trainer side's function (module docstring).
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"expected logits [N, V] and target_ids [N], got {tuple(logits.shape)} and {tuple(target_ids.shape)}"
        )
    with torch.no_grad():
        if parity:
            return _parity_prompt_logprobs(logits.detach(), target_ids, k)
        x = logits.detach().float()
        lse = logsumexp_rows(x)
        target = target_ids.to(device=x.device, dtype=torch.int64)
        lp = x.gather(1, target.unsqueeze(1)).squeeze(1).double() - lse
        if k <= 0 or x.shape[0] == 0:
            return lp.float().cpu(), None, None
        vals, ids = topk_desc(x, k)
        return lp.float().cpu(), ids.cpu(), (vals.double() - lse.unsqueeze(1)).float().cpu()


def _parity_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    target = target_ids.to(device=logits.device, dtype=torch.int64)
    lp = token_logprobs(logits, target).cpu()
    if k <= 0 or logits.shape[0] == 0:
        return lp, None, None
    _, ids = topk_desc(logits.float(), k)
    # One call per candidate rank: a [N, k, V] copy of the logits would not fit for long prompts.
    top = torch.stack([token_logprobs(logits, ids[:, j].contiguous()) for j in range(ids.shape[1])], dim=1)
    return lp, ids.cpu(), top.cpu()


def record_prompt_logprobs(rows: list[PromptLogprobRows], logits: torch.Tensor, parity: bool = False) -> None:
    """Appends to each request's ``prompt_logprobs`` the entries its ``rows`` of ``logits`` score:
    the prompt token's logprob, plus the top ``params.prompt_logprobs`` candidates (``parity``: see
    the module docstring)."""
    targets: list[int] = []
    for r in rows:
        targets.extend(r.request.token_ids[r.first_token : r.first_token + r.count])
    k = max(r.request.params.prompt_logprobs or 0 for r in rows)
    target_lp, top_ids, top_lp = prompt_logprobs(
        logits, torch.tensor(targets, device=logits.device), k, parity=parity
    )
    target_lp = target_lp.tolist()
    top_ids = top_ids.tolist() if top_ids is not None else None
    top_lp = top_lp.tolist() if top_lp is not None else None
    for r in rows:
        want = r.request.params.prompt_logprobs or 0
        for j in range(r.row_start, r.row_start + r.count):
            entry = {targets[j]: target_lp[j]}
            if want and top_ids is not None:
                for tok, lp in zip(top_ids[j][:want], top_lp[j][:want]):
                    entry.setdefault(tok, lp)
            r.request.prompt_logprobs.append(entry)
