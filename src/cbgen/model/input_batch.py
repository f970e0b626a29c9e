"""SchedulerOutput -> packed model inputs.

No padding is ever computed: all scheduled tokens are concatenated into one row.  Single-token rows
(decodes) come first so attention can treat them as one gathered batch; prefill chunks follow.
Only the rows that sample (plus prompt-logprob rows when asked for) go through the LM head.
Per-step CPU work is O(batch) numpy for decodes; prefill chunks cost O(their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbgen.core.update import sampling_sequences
from cbgen.model.attention import AttentionMetadata, PrefillSeq
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

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed batch."""
        return int(self.input_ids.shape[0])


class InputBuilder:
    """Builds :class:`ModelInput` for the runner."""

    def __init__(self, block_size: int, device: torch.device, row_prefill_max: int = 0) -> None:
        self.block_size = block_size
        self.device = device
        # Prefill chunks of at most this many tokens are attended by the decode kernel, one row per
        # query token (see AttentionMetadata.row_prefill_*); 0 = never.
        self.row_prefill_max = row_prefill_max

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(array).to(dtype)
        if self.device.type != "cpu":
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def build(self, scheduled: list[tuple[Request, int]], kv_caches: list) -> ModelInput:
        """Packs the scheduled tokens; see the module docstring for the layout."""
        bs = self.block_size
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        order = decodes + prefills
        nd = len(decodes)

        token_chunks: list[list[int]] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []

        decode_bt = decode_lens = None
        decode_max_len = 0
        if nd:
            computed = np.fromiter((r.num_computed_tokens for r, _ in decodes), dtype=np.int64, count=nd)
            # A pending token (overlap scheduling) is not known yet: 0 holds its place until the
            # runner patches in the device-side value (``pending_rows``).
            token_chunks.append([0 if r.pending else r.token_ids[r.num_computed_tokens] for r, _ in decodes])
            lens = computed + 1
            decode_max_len = int(lens.max())
            width = -(-decode_max_len // bs)
            # One flat fill instead of a numpy slice assignment per row (~1 us each, every step).
            flat: list[int] = []
            counts: list[int] = []
            for r, _ in decodes:
                ids = r.block_ids[:width]
                flat.extend(ids)
                counts.append(len(ids))
            table = np.zeros((nd, width), dtype=np.int64)
            table[np.arange(width) < np.array(counts)[:, None]] = flat
            slot_chunks.append(table[np.arange(nd), computed // bs] * bs + computed % bs)
            pos_chunks.append(computed)
            decode_bt = self._to_device(table, torch.int32)
            decode_lens = self._to_device(lens, torch.int32)

        prefill_seqs: list[PrefillSeq] = []
        row_idx: list[np.ndarray] = []
        row_tables: list[tuple[np.ndarray, int]] = []  # (block ids, how many rows use them)
        q_start = nd
        for r, n in prefills:
            c = r.num_computed_tokens
            token_chunks.append(r.token_ids[c : c + n])
            pos = np.arange(c, c + n, dtype=np.int64)
            blocks = np.asarray(r.block_ids, dtype=np.int64)
            slot_chunks.append(blocks[pos // bs] * bs + pos % bs)
            pos_chunks.append(pos)
            as_rows = n <= self.row_prefill_max
            if as_rows:
                row_idx.append(np.arange(q_start, q_start + n, dtype=np.int64))
                row_tables.append((blocks[: -(-(c + n) // bs)], n))
            table = (
                self._to_device(blocks[: -(-(c + n) // bs)], torch.int32) if c > 0 and not as_rows else None
            )
            prefill_seqs.append(PrefillSeq(q_start, n, c, table, as_rows=as_rows))
            q_start += n

        input_ids = (
            np.concatenate([np.asarray(chunk, dtype=np.int64) for chunk in token_chunks])
            if token_chunks
            else np.zeros(0, np.int64)
        )
        positions = np.concatenate(pos_chunks) if pos_chunks else np.zeros(0, np.int64)
        slots = np.concatenate(slot_chunks) if slot_chunks else np.zeros(0, np.int64)

        # Rows for the LM head: prompt-logprob rows first, then one row per sampled sequence.
        prompt_rows: list[PromptLogprobRows] = []
        prompt_idx: list[np.ndarray] = []
        sample_idx: list[int] = []
        sample_requests: list[Request] = []
        start = 0
        num_prompt_rows = 0
        for r, n in order:
            c = r.num_computed_tokens
            if r.params.prompt_logprobs is not None and r.prompt_logprobs is not None:
                # logits at position p score prompt token p + 1
                lo = max(c, len(r.prompt_logprobs) - 1)
                hi = min(c + n, r.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_rows.append(PromptLogprobRows(r, num_prompt_rows, lo + 1, hi - lo))
                    prompt_idx.append(np.arange(start + lo - c, start + hi - c))
                    num_prompt_rows += hi - lo
            sequences = sampling_sequences(r, n)
            if sequences:
                sample_idx += [start + n - 1] * len(sequences)
                sample_requests += sequences
            start += n
        logits_rows = np.concatenate([*prompt_idx, np.asarray(sample_idx, dtype=np.int64)])

        meta = AttentionMetadata(
            kv_caches=kv_caches,
            slot_mapping=self._to_device(slots, torch.int64),
            num_decode=nd,
            decode_block_table=decode_bt,
            decode_seq_lens=decode_lens,
            decode_max_len=decode_max_len,
            prefills=prefill_seqs,
        )
        if row_idx:
            rows = np.concatenate(row_idx)
            lens = positions[rows] + 1  # each query token sees its prefix and itself
            table = np.zeros((len(rows), max(len(t) for t, _ in row_tables)), dtype=np.int64)
            at = 0
            for blocks, count in row_tables:
                table[at : at + count, : len(blocks)] = blocks
                at += count
            meta.row_prefill_idx = self._to_device(rows, torch.int64)
            meta.row_prefill_table = self._to_device(table, torch.int32)
            meta.row_prefill_lens = self._to_device(lens, torch.int32)
            meta.row_prefill_max_len = int(lens.max())
        return ModelInput(
            pending_rows=[(row, r) for row, (r, _) in enumerate(decodes) if r.pending],
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            logits_indices=self._to_device(logits_rows.astype(np.int64), torch.int64),
            meta=meta,
            scheduled=order,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            num_prompt_rows=num_prompt_rows,
        )
