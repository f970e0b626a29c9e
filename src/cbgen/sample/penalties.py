"""Stage 0/1 logits edits: ``min_tokens`` bans, repetition, frequency and presence penalties, logit bias.

They work on a private, contiguous float32 ``[B, V]`` tensor in place, through its flat view, so
their cost is proportional to the number of touched entries rather than to ``B * V``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from cbgen.request import Request
from cbgen.sample.row_ops import NEG_INF


def _flat_index(rows: torch.Tensor, cols: torch.Tensor, vocab: int) -> torch.Tensor:
    return rows * vocab + cols


def apply_banned_tokens(logits: torch.Tensor, rows: Sequence[int], cols: Sequence[int]) -> None:
    """Sets ``logits[rows[j], cols[j]] = -inf`` (used for ``min_tokens`` suppression)."""
    if not rows:
        return
    dev = logits.device
    idx = _flat_index(torch.tensor(rows, device=dev), torch.tensor(cols, device=dev), logits.shape[1])
    logits.view(-1).index_fill_(0, idx, NEG_INF)


def _token_index(
    requests: Sequence[Request], rows: Sequence[int], vocab: int, outputs_only: bool
) -> torch.Tensor:
    """Flat ``row * V + token`` indices of each listed row's (prompt+output or output) tokens, on the
    host: deduplicating there keeps the data-dependent sizes away from the device (no sync)."""
    lists = []
    for r in rows:
        req = requests[r]
        lists.append(req.token_ids[req.num_prompt_tokens :] if outputs_only else req.token_ids)
    lengths = [len(t) for t in lists]
    # np.fromiter over a chain is several times faster than torch.tensor on a long Python list.
    tok = torch.from_numpy(
        np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(lengths))
    )
    row = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), torch.tensor(lengths))
    keep = (tok >= 0) & (tok < vocab)
    return _flat_index(row[keep], tok[keep], vocab)


def apply_repetition_penalty(
    logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int], penalties: Sequence[float]
) -> None:
    """``transformers`` semantics: every distinct prompt or output token is penalised once,
    positive logits divided by the penalty and negative ones multiplied by it."""
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    # Deduplicate so each entry is written exactly once: writes with duplicate indices are
    # nondeterministic in general.  index_put_ (not index_copy_/index_add_) is used for writes
    # because it stays allowed under torch.use_deterministic_algorithms on GPUs.
    idx = torch.unique(_token_index(requests, rows, vocab, False)).to(dev)
    per_row = torch.ones(logits.shape[0], dtype=torch.float32, device=dev)
    per_row[torch.tensor(rows, device=dev)] = torch.tensor(penalties, dtype=torch.float32, device=dev)
    pen = per_row[idx // vocab]
    flat = logits.view(-1)
    vals = flat.index_select(0, idx)
    flat.index_put_((idx,), torch.where(vals > 0, vals / pen, vals * pen))


def apply_frequency_presence(
    logits: torch.Tensor,
    requests: Sequence[Request],
    rows: Sequence[int],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """OpenAI/vLLM semantics over OUTPUT tokens: ``logit -= frequency * count + presence * (count > 0)``."""
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    idx = _token_index(requests, rows, vocab, True)
    if idx.numel() == 0:
        return
    uniq, counts = torch.unique(idx, return_counts=True)
    uniq, counts = uniq.to(dev), counts.to(dev)
    row_ids = torch.tensor(rows, device=dev)
    freq = torch.zeros(logits.shape[0], dtype=torch.float32, device=dev)
    pres = torch.zeros(logits.shape[0], dtype=torch.float32, device=dev)
    freq[row_ids] = torch.tensor(frequency, dtype=torch.float32, device=dev)
    pres[row_ids] = torch.tensor(presence, dtype=torch.float32, device=dev)
    r = uniq // vocab
    delta = freq[r] * counts.to(torch.float32) + pres[r]
    flat = logits.view(-1)
    flat.index_put_((uniq,), flat.index_select(0, uniq) - delta)


def apply_logit_bias(
    logits: torch.Tensor, rows: Sequence[int], cols: Sequence[int], values: Sequence[float]
) -> None:
    """Adds ``values[j]`` to ``logits[rows[j], cols[j]]`` (pairs are unique: they come from dicts)."""
    if not rows:
        return
    dev = logits.device
    idx = _flat_index(torch.tensor(rows, device=dev), torch.tensor(cols, device=dev), logits.shape[1])
    flat = logits.view(-1)
    flat.index_put_((idx,), flat.index_select(0, idx) + torch.tensor(values, dtype=torch.float32, device=dev))


__all__ = ["apply_banned_tokens", "apply_frequency_presence", "apply_logit_bias", "apply_repetition_penalty"]
