"""SchedulerOutput -> packed model inputs.

No padding is ever computed: all scheduled tokens are concatenated into one row.  The builder makes
the step's backend-neutral description first (:class:`cbgen.model.step_batch.StepBatch`: per row the
query span, the blocks it reads and the slots it writes in every cache group, its state slot, the
positions it samples), then asks the backend's metadata deriver for the attention metadata
(:class:`cbgen.model.paged_metadata.PagedMetadata` for cbgen's paged backends), which also decides
the rows' order.  Only the rows that sample (plus prompt-logprob rows when asked for) go through the
LM head.  Per-step CPU work is O(batch) numpy for decodes; prefill chunks cost O(their tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cbgen.model import state_pieces
from cbgen.model.attention import AttentionMetadata
from cbgen.model.paged_metadata import PagedMetadata
from cbgen.model.state_pieces import StatePiece
from cbgen.model.step_batch import StepBatch, build_step_batch
from cbgen.request import Request


@dataclass
class PromptLogprobRows:
    """Logits rows ``[row_start, row_start + count)`` give the logprobs of prompt tokens
    ``first_token .. first_token + count - 1`` of ``request``."""

    request: Request
    row_start: int
    first_token: int
    count: int


@dataclass
class ModelInput:
    """One step's packed tensors and the bookkeeping needed to read the results back."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [R] rows of the packed batch that go through the LM head
    meta: AttentionMetadata
    scheduled: list[tuple[Request, int]]  # in packed order
    sample_requests: list[Request]  # one per sampled logits row (after the prompt-logprob rows)
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    num_prompt_rows: int = 0
    # Overlap scheduling: (row, request) whose input token was still on the device at build time
    # (decode rows, so the row is also the packed position).
    pending_rows: list[tuple[int, Request]] = field(default_factory=list)
    # [T] int64, each token's extent max(prompt length, position + 1, its request's rope_floor), for
    # models whose rotary frequencies depend on the sequence length (cbgen.model.rotary); else None.
    rope_extents: torch.Tensor | None = None
    # The backend-neutral description the metadata was derived from (host arrays).
    step: StepBatch | None = None
    # A model with state layers: the forwards the step runs as (cbgen.model.state_pieces).
    pieces: list[StatePiece] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed batch."""
        return int(self.input_ids.shape[0])


class InputBuilder:
    """Builds :class:`ModelInput` for the runner.

    ``block_size`` and ``num_blocks``: the cache groups' block sizes and pool sizes (one int each for
    the single group of today's models).  ``metadata``: the backend's deriver (default: the paged
    backends' with chunks as rows up to ``row_prefill_max`` tokens).  ``with_state``: the model keeps
    a state per sequence, so every row must hold a state slot, and the step runs as the forwards of
    :mod:`cbgen.model.state_pieces`.
    """

    def __init__(
        self,
        block_size: int | Sequence[int],
        device: torch.device,
        row_prefill_max: int = 0,
        num_blocks: int | Sequence[int] | None = None,
        rope_extents: bool = False,
        metadata: PagedMetadata | None = None,
        with_state: bool = False,
    ) -> None:
        self.block_sizes = (block_size,) if isinstance(block_size, int) else tuple(block_size)
        if num_blocks is None or isinstance(num_blocks, int):
            num_blocks = (num_blocks,) * len(self.block_sizes)
        # The cache's size per group: every block id of a step is checked against it on the host,
        # before it reaches a device kernel that could not check it without a sync.
        self.num_blocks = tuple(num_blocks)
        self.device = device
        # Whether steps carry ModelInput.rope_extents.
        self.rope_extents = rope_extents
        self.metadata = metadata if metadata is not None else PagedMetadata(row_prefill_max)
        self.with_state = with_state

    @property
    def row_prefill_max(self) -> int:
        """Chunks up to this many tokens are laid out as decode rows (the deriver's setting)."""
        return getattr(self.metadata, "row_prefill_max", 0)

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(array).to(dtype)
        if self.device.type != "cpu":
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def build(self, scheduled: list[tuple[Request, int]], kv_caches: list) -> ModelInput:
        """Packs the scheduled tokens; see the module docstring for the layout."""
        order = state_pieces.order(scheduled) if self.with_state else self.metadata.order(scheduled)
        batch = build_step_batch(order, self.block_sizes, self.num_blocks, self.with_state)
        meta = self.metadata.build(batch, kv_caches, self._to_device)
        logits_rows, sample_requests, prompt_rows, num_prompt_rows = _logits_rows(batch)
        pieces = None
        if self.with_state:
            pieces = state_pieces.split(batch, self.metadata, kv_caches, self._to_device)
        extents = None
        if self.rope_extents:
            floors = np.fromiter(
                (max(r.num_prompt_tokens, r.rope_floor) for r, _ in order), np.int64, count=len(order)
            )
            extents = self._to_device(
                np.maximum(np.repeat(floors, batch.q_lens), batch.positions + 1), torch.int64
            )
        return ModelInput(
            pending_rows=[(row, r) for row, (r, n) in enumerate(order) if r.pending and n == 1],
            input_ids=self._to_device(batch.token_ids, torch.int64),
            positions=self._to_device(batch.positions, torch.int64),
            logits_indices=self._to_device(logits_rows, torch.int64),
            meta=meta,
            scheduled=order,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            num_prompt_rows=num_prompt_rows,
            rope_extents=extents,
            step=batch,
            pieces=pieces,
        )


def _logits_rows(batch: StepBatch) -> tuple[np.ndarray, list[Request], list[PromptLogprobRows], int]:
    """Rows for the LM head: prompt-logprob rows first, then, per sampling sequence, its row's last
    ``sample_counts`` positions (one, or one per draft and one after them)."""
    prompt_rows: list[PromptLogprobRows] = []
    prompt_idx: list[np.ndarray] = []
    sample_idx: list[int] = []
    sample_requests: list[Request] = []
    num_prompt_rows = 0
    starts = batch.q_starts.tolist()
    counts = batch.sample_counts.tolist()
    for (r, n), start, count, seqs in zip(batch.rows, starts, counts, batch.samplers):
        if r.prompt_logprobs is not None:
            c = r.num_computed_tokens
            # logits at position p score prompt token p + 1
            lo = max(c, len(r.prompt_logprobs) - 1)
            hi = min(c + n, r.num_prompt_tokens - 1)
            if hi > lo:
                prompt_rows.append(PromptLogprobRows(r, num_prompt_rows, lo + 1, hi - lo))
                prompt_idx.append(np.arange(start + lo - c, start + hi - c))
                num_prompt_rows += hi - lo
        if count == 1:
            sample_idx += [start + n - 1] * len(seqs)
            sample_requests += seqs
        elif count:
            for seq in seqs:
                sample_idx += range(start + n - count, start + n)
                sample_requests += [seq] * count
    rows = np.concatenate([*prompt_idx, np.asarray(sample_idx, dtype=np.int64)]).astype(np.int64)
    return rows, sample_requests, prompt_rows, num_prompt_rows
