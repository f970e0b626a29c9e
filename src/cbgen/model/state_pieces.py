"""A step of a model with state layers, cut into the forwards that keep every sequence's state its own.

transformers' state-space and linear-attention functions cannot keep packed sequences apart (their
torch versions refuse ``cu_seqlens``/``seq_idx``, and padding would still decay a state), so a step
of such a model is not one packed row.  It runs as:

* one forward of all its continuing single-token rows (decodes, and the one-token replays of a
  resumed sequence) as a batch of one-token rows, ``[B, 1]``: the mixers' recurrent form, as
  ``generate()`` decodes;
* one forward per other row (a prefill chunk, or a sequence's first token), ``[1, L]``: the
  mixers' chunk form, as ``generate()`` prefills, from the row's state (none at its first token).

Attention layers attend each forward through the paged backend as usual, with metadata derived for
that forward's rows.  Each forward sends through the LM head only the positions the step samples or
scores (:func:`logits_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from cbgen.model.attention import AttentionMetadata
from cbgen.model.paged_metadata import PagedMetadata, ToDevice
from cbgen.model.step_batch import StepBatch
from cbgen.request import Request


@dataclass
class StatePiece:
    """One forward of a state model's step (see the module docstring)."""

    tokens: slice  # its tokens in the step's packed order
    batch: int  # rows as a batch of one-token rows (decodes), or 1
    fresh: bool  # its row starts its sequence: no state to read
    past: int  # tokens of its (first) row already computed
    slots: torch.Tensor  # [batch] state slots
    meta: AttentionMetadata

    @property
    def shape(self) -> tuple[int, int]:
        """The forward's input shape."""
        n = self.tokens.stop - self.tokens.start
        return (self.batch, 1) if self.batch > 1 or (n == 1 and not self.fresh) else (1, n)


def order(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """Continuing single-token rows first (the batched decode forward), then the rest."""
    decodes = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
    others = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
    return decodes + others


def split(
    batch: StepBatch, metadata: PagedMetadata, kv_caches: list, to_device: ToDevice
) -> list[StatePiece]:
    """The forwards of ``batch`` (rows in :func:`order`'s order)."""
    if batch.state_slots is None:
        raise RuntimeError("a step of a model with state layers came without state slots")
    q_lens, ctx = batch.q_lens, batch.ctx_lens
    decoding = (q_lens == 1) & (ctx > 0)
    nd = int(np.searchsorted(~decoding, True)) if decoding.size else 0
    spans = ([(0, nd)] if nd else []) + [(i, i + 1) for i in range(nd, batch.num_rows)]
    pieces = []
    for lo, hi in spans:
        t0 = int(batch.q_starts[lo])
        t1 = int(batch.q_starts[hi - 1] + q_lens[hi - 1])
        sub = _rows(batch, lo, hi, t0, t1)
        pieces.append(
            StatePiece(
                tokens=slice(t0, t1),
                batch=hi - lo if lo < nd else 1,
                fresh=lo >= nd and int(ctx[lo]) == 0,
                past=int(ctx[lo]),
                slots=to_device(batch.state_slots[lo:hi], torch.int64),
                meta=metadata.build(sub, kv_caches, to_device),
            )
        )
    return pieces


def logits_rows(piece: StatePiece, logits_indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For the step's logits rows ``logits_indices`` (packed positions): the piece's positions
    that need logits (``keep``, unique and sorted: tokens of a prefill row, rows of the decode
    batch), and which step rows (``dest``) take which of them (``src``)."""
    t0, t1 = piece.tokens.start, piece.tokens.stop
    wanted = (logits_indices >= t0) & (logits_indices < t1)
    dest = wanted.nonzero().view(-1)
    keep, src = torch.unique(logits_indices[dest] - t0, sorted=True, return_inverse=True)
    return keep, dest, src


def _rows(batch: StepBatch, lo: int, hi: int, t0: int, t1: int) -> StepBatch:
    """Rows ``lo..hi`` of ``batch`` (tokens ``t0..t1``) as a step batch of their own."""
    return replace(
        batch,
        rows=batch.rows[lo:hi],
        q_starts=batch.q_starts[lo:hi] - t0,
        q_lens=batch.q_lens[lo:hi],
        ctx_lens=batch.ctx_lens[lo:hi],
        token_ids=batch.token_ids[t0:t1],
        positions=batch.positions[t0:t1],
        tables=tuple(t[lo:hi] for t in batch.tables),
        table_counts=tuple(c[lo:hi] for c in batch.table_counts),
        slots=tuple(s[t0:t1] for s in batch.slots),
        state_slots=batch.state_slots[lo:hi],
        sample_counts=batch.sample_counts[lo:hi],
        samplers=batch.samplers[lo:hi],
    )
