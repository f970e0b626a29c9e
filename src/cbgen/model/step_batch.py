"""One step as every attention backend sees it: the backend-neutral step batch.

The input builder (:mod:`cbgen.model.input_batch`) turns the scheduler's ``(request, tokens)`` pairs,
in packed order, into a :class:`StepBatch`: per row (one scheduled sequence) its query span, the
blocks it reads in every cache group, the cache slot each of its query tokens writes in every group,
its state slot, and how many of its last positions sample.  Host numpy arrays only, and nothing one
backend wants more than another: each backend derives its own metadata from it
(:class:`cbgen.model.paged_metadata.PagedMetadata` for cbgen's paged backends; a new cache kind or a
new kernel family adds its own deriver, not fields here).

Row ``i``'s query tokens are ``[q_starts[i], q_starts[i] + q_lens[i])`` of the packed batch; its
sequence already has ``ctx_lens[i]`` tokens in the cache, so its token ``j`` sits at position
``ctx_lens[i] + j`` and attends to the sequence's first ``ctx_lens[i] + j + 1`` tokens.  A row with
drafts (a drafter's proposals, :attr:`cbgen.request.Request.draft_token_ids`) is a row of several
query tokens that samples at each draft's position and after the last: ``sample_counts[i]`` is
``1 + drafts`` when the row samples this step, else 0 (mid-prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cbgen.core.update import sampling_sequences
from cbgen.request import Request


@dataclass
class StepBatch:
    """One step's rows in packed order (see the module docstring); int64 numpy arrays."""

    rows: list[tuple[Request, int]]
    q_starts: np.ndarray  # [R]
    q_lens: np.ndarray  # [R]
    ctx_lens: np.ndarray  # [R] tokens of the sequence already in the cache
    token_ids: np.ndarray  # [T]; 0 holds the place of a token still on the device (pending)
    positions: np.ndarray  # [T]
    block_sizes: tuple[int, ...]  # per cache group
    # Per cache group: [R, W] the blocks each row reads (the first ceil((ctx + q) / block size)
    # entries; 0 past them), and [T] the slot each query token's entry is written to.
    tables: tuple[np.ndarray, ...]
    table_counts: tuple[np.ndarray, ...]  # per group, [R] the blocks each row reads
    slots: tuple[np.ndarray, ...]
    state_slots: np.ndarray | None  # [R] the row's state slot; None when the model keeps no state
    sample_counts: np.ndarray  # [R] positions sampled at the row's end (0: the row does not sample)
    # [R] the sequences that sample from each row: the row's own, and its n > 1 followers when the
    # row completes their shared prompt (cbgen.core.update.sampling_sequences); [] mid-prefill.
    samplers: list[list[Request]]

    @property
    def num_rows(self) -> int:
        """Scheduled sequences."""
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the packed batch."""
        return int(self.positions.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        """[R] each row's sequence length once this step's tokens are in."""
        return self.ctx_lens + self.q_lens


def build_step_batch(
    order: list[tuple[Request, int]],
    block_sizes: Sequence[int],
    num_blocks: Sequence[int | None],
    with_state: bool = False,
) -> StepBatch:
    """The step batch of ``order`` (rows in packed order).  Every block id is checked against its
    group's ``num_blocks`` here, on the host, before it can reach a device kernel that could not
    check it without a sync."""
    nr = len(order)
    rows = _Rows.read(order)
    ctx, tokens, samplers = np.asarray(rows.ctx, dtype=np.int64), rows.tokens, rows.samplers
    num_tokens = len(tokens)
    if num_tokens == nr:  # every row one token (a decode-only step): no spans to expand
        q_lens = np.ones(nr, dtype=np.int64)
        q_starts = row_of = np.arange(nr, dtype=np.int64)
        positions = ctx
    else:
        q_lens = np.fromiter((n for _, n in order), dtype=np.int64, count=nr)
        q_starts = np.zeros(nr, dtype=np.int64)
        if nr > 1:
            np.cumsum(q_lens[:-1], out=q_starts[1:])
        row_of = np.repeat(np.arange(nr), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(ctx - q_starts, q_lens)
    seq_lens = ctx + q_lens
    tables, slots, counts = [], [], []
    for group, (bs, limit) in enumerate(zip(block_sizes, num_blocks)):
        counts.append(-(-seq_lens // bs))
        table = _table(order, group, counts[-1])
        if limit is not None and table.size and not 0 <= table.min() <= table.max() < limit:
            raise RuntimeError(
                f"a step's block table holds a block outside the KV cache: {table.min()}..{table.max()}"
            )
        tables.append(table)
        slots.append(table[row_of, positions // bs] * bs + positions % bs)
    state_slots = None
    if with_state:
        held = [r.state_slot for r, _ in order]
        if any(s is None for s in held):
            raise RuntimeError("a row of a model with per-sequence state holds no state slot")
        state_slots = np.asarray(held, dtype=np.int64)
    samples = np.asarray(rows.sample_counts, dtype=np.int64)
    if rows.drafted and (samples > q_lens).any():
        raise RuntimeError(
            "a row samples at positions that are not in its step (drafts without their last token)"
        )
    return StepBatch(
        rows=order,
        q_starts=q_starts,
        q_lens=q_lens,
        ctx_lens=ctx,
        token_ids=np.asarray(tokens, dtype=np.int64),
        positions=positions,
        block_sizes=tuple(block_sizes),
        tables=tuple(tables),
        table_counts=tuple(counts),
        slots=tuple(slots),
        state_slots=state_slots,
        sample_counts=samples,
        samplers=samplers,
    )


def _table(order: list[tuple[Request, int]], group: int, counts: np.ndarray) -> np.ndarray:
    """[R, max(counts)] the first ``counts[i]`` blocks of each row's table for ``group``, 0 after.
    Padding stays 0: every kernel stops at the row's length, and the torch reference zeroes what its
    mask hides, so block 0's content is never read for another row."""
    width = int(counts.max()) if counts.size else 0
    flat: list[int] = []  # one flat fill instead of a numpy slice assignment per row (~1 us each)
    for (r, _), count in zip(order, counts.tolist()):
        flat.extend(r.block_tables[group][:count])
    if len(flat) != int(counts.sum()):
        for (r, _), count in zip(order, counts.tolist()):
            if len(r.block_tables[group]) < count:
                raise RuntimeError(
                    f"request {r.request_id} holds {len(r.block_tables[group])} blocks of cache group "
                    f"{group}, its step needs {count}"
                )
    table = np.zeros((len(order), width), dtype=np.int64)
    table[np.arange(width) < counts[:, None]] = flat
    return table


@dataclass
class _Rows:
    """What the step batch needs of each row's request, read in one pass (this runs every step:
    per-row numpy calls or repeated passes cost more than the arithmetic)."""

    ctx: list[int]
    tokens: list[int]  # the query tokens in packed order: from the first uncomputed one, then drafts
    samplers: list[list[Request]]
    sample_counts: list[int]
    drafted: bool

    @classmethod
    def read(cls, order: list[tuple[Request, int]]) -> _Rows:
        rows = cls([], [], [], [], False)
        for r, n in order:
            c = r.num_computed_tokens
            rows.ctx.append(c)
            drafts = r.draft_token_ids
            if n == 1 and not drafts:
                # A pending token (overlap scheduling) is not known yet: 0 holds its place until the
                # runner patches in the device-side value (``ModelInput.pending_rows``).
                rows.tokens.append(0 if r.pending else r.token_ids[c])
            else:
                have = len(r.token_ids)
                rows.tokens.extend(r.token_ids[c : c + n])
                if c + n > have:
                    rows.tokens.extend(drafts[max(0, c - have) : c + n - have])
                rows.drafted = rows.drafted or bool(drafts)
            seqs = sampling_sequences(r, n)
            rows.samplers.append(seqs)
            rows.sample_counts.append(1 + len(drafts) if seqs else 0)
        return rows
