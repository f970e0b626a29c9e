"""The paged backends' metadata, derived from the backend-neutral step batch.

cbgen's attention backends (torch reference, C, Triton, flash-attn; :mod:`cbgen.model.backends`)
all read one :class:`~cbgen.model.attention.AttentionMetadata` per step: the single-token rows as
one gathered decode batch, the other rows as prefill chunks in varlen form, and, where the plan says
so, short chunks laid out as decode-kernel rows (one row per query token).  :class:`PagedMetadata`
is the deriver: it says how it wants the rows ordered (:meth:`PagedMetadata.order`) and turns a
:class:`~cbgen.model.step_batch.StepBatch` into that metadata (:meth:`PagedMetadata.build`), for
one cache group.  The row-prefill limit is the plan's decision (``ExecutionPlan.row_prefill_max``),
handed to the deriver when the engine builds it; the input builder knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cbgen.model.attention import AttentionMetadata, PrefillSeq, VarlenPrefill
from cbgen.model.step_batch import StepBatch
from cbgen.request import Request

ToDevice = Callable[[np.ndarray, torch.dtype], torch.Tensor]


class PagedMetadata:
    """Derives :class:`AttentionMetadata` of cache group ``group`` from a step batch."""

    def __init__(self, row_prefill_max: int = 0, group: int = 0) -> None:
        # Prefill chunks of at most this many tokens are attended by the decode kernel, one row per
        # query token (see AttentionMetadata.row_prefill_*); 0 = never.
        self.row_prefill_max = row_prefill_max
        self.group = group

    def order(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Single-token rows first (one gathered decode batch), then the chunks attended as decode
        rows (one range of the batch), then the other chunks."""
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        if self.row_prefill_max:
            limit = self.row_prefill_max
            prefills = [p for p in prefills if p[1] <= limit] + [p for p in prefills if p[1] > limit]
        return decodes + prefills

    def build(self, batch: StepBatch, kv_caches: list, to_device: ToDevice) -> AttentionMetadata:
        """The metadata of ``batch`` (rows in :meth:`order`'s order)."""
        g = self.group
        if batch.num_tokens == batch.num_rows:
            nd = batch.num_rows
        else:
            nd = int(np.searchsorted(batch.q_lens != 1, True))
        meta = AttentionMetadata(
            kv_caches=kv_caches,
            slot_mapping=to_device(batch.slots[g], torch.int64),
            num_decode=nd,
            decode_block_table=None,
            decode_seq_lens=None,
            decode_max_len=0,
            prefills=[],
        )
        counts = batch.table_counts[g]
        if nd:
            lens = batch.ctx_lens[:nd] + 1
            meta.decode_max_len = int(lens.max())
            width = int(counts[:nd].max())
            meta.decode_block_table = to_device(
                np.ascontiguousarray(batch.tables[g][:nd, :width]), torch.int32
            )
            meta.decode_seq_lens = to_device(lens, torch.int32)
        if nd < batch.num_rows:
            self._prefills(batch, nd, counts, meta, to_device)
        return meta

    def _prefills(
        self, batch: StepBatch, nd: int, counts: np.ndarray, meta: AttentionMetadata, to_device: ToDevice
    ) -> None:
        """The chunks after the decode rows, in varlen form, and the leading short ones as rows."""
        q_starts, q_lens, ctx = batch.q_starts[nd:], batch.q_lens[nd:], batch.ctx_lens[nd:]
        limit = self.row_prefill_max
        for q_start, q_len, c in zip(q_starts.tolist(), q_lens.tolist(), ctx.tolist()):
            as_rows = q_len <= limit
            meta.prefills.append(PrefillSeq(q_start, q_len, c, as_rows=as_rows))
            if as_rows:
                meta.row_prefill_chunks += 1
                meta.row_prefill_tokens += q_len
        table = batch.tables[self.group][nd:]
        meta.varlen = _varlen(q_lens, ctx, table[:, : int(counts[nd:].max())], to_device)
        if meta.row_prefill_chunks:
            k = meta.row_prefill_chunks
            width = int(counts[nd : nd + k].max())
            rows = np.repeat(table[:k, :width], q_lens[:k], axis=0)
            lo = meta.num_decode
            lens = batch.positions[lo : lo + meta.row_prefill_tokens] + 1  # its prefix and itself
            meta.row_prefill_table = to_device(rows, torch.int32)
            meta.row_prefill_lens = to_device(lens, torch.int32)
            meta.row_prefill_max_len = int(lens.max())


def _varlen(q_lens: np.ndarray, ctx: np.ndarray, table: np.ndarray, to_device: ToDevice) -> VarlenPrefill:
    """The chunks' lengths and block table, sent to the device in a single copy."""
    n, width = table.shape
    k_lens = q_lens + ctx
    # One int32 buffer: cu_seqlens_q [n + 1], cu_seqlens_k [n + 1], seq_lens_k [n], table [n, width].
    buf = np.zeros(3 * n + 2 + n * width, dtype=np.int64)
    np.cumsum(q_lens, out=buf[1 : n + 1])
    np.cumsum(k_lens, out=buf[n + 2 : 2 * n + 2])
    buf[2 * n + 2 : 3 * n + 2] = k_lens
    buf[3 * n + 2 :] = table.reshape(-1)
    dev = to_device(buf, torch.int32)
    return VarlenPrefill(
        cu_seqlens_q=dev[: n + 1],
        cu_seqlens_k=dev[n + 1 : 2 * n + 2],
        seq_lens_k=dev[2 * n + 2 : 3 * n + 2],
        block_table=dev[3 * n + 2 :].view(n, width),
        max_q_len=int(q_lens.max()),
        max_k_len=int(k_lens.max()),
        num_tokens=int(q_lens.sum()),
    )
