"""SchedulerOutput -> packed model inputs.

No padding is ever computed: all scheduled tokens are concatenated into one row.  Single-token rows
(decodes) come first so attention can treat them as one gathered batch; prefill chunks follow, those
the backend attends as decode rows (``row_prefill_max``) first, and are described once more in
varlen form (:class:`cbgen.model.attention.VarlenPrefill`) for kernels that attend them all at once.
Only the rows that sample (plus prompt-logprob rows when asked for) go through the LM head.
Per-step CPU work is O(batch) numpy for decodes; prefill chunks cost O(their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbgen.core.update import sampling_sequences
from cbgen.model.attention import AttentionMetadata, PrefillSeq, VarlenPrefill
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

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed batch."""
        return int(self.input_ids.shape[0])


class InputBuilder:
    """Builds :class:`ModelInput` for the runner."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        row_prefill_max: int = 0,
        num_blocks: int | None = None,
        rope_extents: bool = False,
    ) -> None:
        self.block_size = block_size
        # Whether steps carry ModelInput.rope_extents.
        self.rope_extents = rope_extents
        self.device = device
        # The cache's size: every block id and slot of a step is checked against it on the host,
        # before it reaches a device kernel that could not check it without a sync.
        self.num_blocks = num_blocks
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
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        if self.row_prefill_max:
            # Chunks attended as decode rows first, so their rows form one range of the batch.
            prefills = [p for p in prefills if p[1] <= self.row_prefill_max] + [
                p for p in prefills if p[1] > self.row_prefill_max
            ]
        order = decodes + prefills
        pack = _Packing()
        meta = AttentionMetadata(
            kv_caches=kv_caches,
            slot_mapping=None,
            num_decode=len(decodes),
            decode_block_table=None,
            decode_seq_lens=None,
            decode_max_len=0,
            prefills=[],
        )
        if decodes:
            self._pack_decodes(decodes, pack, meta)
        if prefills:
            self._pack_prefills(prefills, len(decodes), pack, meta)
        input_ids = np.concatenate(pack.tokens) if pack.tokens else np.zeros(0, np.int64)
        positions = np.concatenate(pack.positions) if pack.positions else np.zeros(0, np.int64)
        slots = np.concatenate(pack.slots) if pack.slots else np.zeros(0, np.int64)
        if (
            self.num_blocks is not None
            and slots.size
            and not 0 <= slots.min() <= slots.max() < self.num_blocks * self.block_size
        ):
            raise RuntimeError(f"a step addresses a slot outside the KV cache ({slots.min()}..{slots.max()})")
        meta.slot_mapping = self._to_device(slots, torch.int64)
        if meta.row_prefill_chunks:
            self._row_prefill_meta(pack.tables[: meta.row_prefill_chunks], positions, meta)
        logits_rows, sample_requests, prompt_rows, num_prompt_rows = _logits_rows(order)
        extents = None
        if self.rope_extents:
            prompt_lens = np.repeat(
                np.fromiter(
                    (max(r.num_prompt_tokens, r.rope_floor) for r, _ in order), np.int64, count=len(order)
                ),
                [n for _, n in order],
            )
            extents = self._to_device(np.maximum(prompt_lens, positions + 1), torch.int64)
        return ModelInput(
            pending_rows=[(row, r) for row, (r, _) in enumerate(decodes) if r.pending],
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            logits_indices=self._to_device(logits_rows, torch.int64),
            meta=meta,
            scheduled=order,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            num_prompt_rows=num_prompt_rows,
            rope_extents=extents,
        )

    def _check_blocks(self, table: np.ndarray) -> None:
        if (
            self.num_blocks is not None
            and table.size
            and not 0 <= table.min() <= table.max() < self.num_blocks
        ):
            raise RuntimeError(
                f"a step's block table holds a block outside the KV cache: {table.min()}..{table.max()}"
            )

    def _pack_decodes(
        self, decodes: list[tuple[Request, int]], pack: _Packing, meta: AttentionMetadata
    ) -> None:
        """Single-token rows: their tokens, positions and slots, and one block table for all."""
        bs, nd = self.block_size, len(decodes)
        computed = np.fromiter((r.num_computed_tokens for r, _ in decodes), dtype=np.int64, count=nd)
        # A pending token (overlap scheduling) is not known yet: 0 holds its place until the runner
        # patches in the device-side value (``pending_rows``).
        pack.tokens.append(
            np.array([0 if r.pending else r.token_ids[r.num_computed_tokens] for r, _ in decodes], np.int64)
        )
        lens = computed + 1
        meta.decode_max_len = int(lens.max())
        width = -(-meta.decode_max_len // bs)
        # One flat fill instead of a numpy slice assignment per row (~1 us each, every step).
        flat: list[int] = []
        counts: list[int] = []
        for r, _ in decodes:
            ids = r.block_ids[:width]
            flat.extend(ids)
            counts.append(len(ids))
        # Padding entries stay 0: every kernel stops at the row's length, and the torch reference
        # zeroes what its mask hides, so block 0's content is never read for another row.
        table = np.zeros((nd, width), dtype=np.int64)
        table[np.arange(width) < np.array(counts)[:, None]] = flat
        self._check_blocks(table)
        pack.slots.append(table[np.arange(nd), computed // bs] * bs + computed % bs)
        pack.positions.append(computed)
        meta.decode_block_table = self._to_device(table, torch.int32)
        meta.decode_seq_lens = self._to_device(lens, torch.int32)

    def _pack_prefills(
        self, prefills: list[tuple[Request, int]], q_start: int, pack: _Packing, meta: AttentionMetadata
    ) -> None:
        """Prefill chunks after the decode rows, and their varlen description."""
        bs = self.block_size
        first = q_start
        for r, n in prefills:
            c = r.num_computed_tokens
            pack.tokens.append(np.asarray(r.token_ids[c : c + n], dtype=np.int64))
            pos = np.arange(c, c + n, dtype=np.int64)
            blocks = np.asarray(r.block_ids, dtype=np.int64)
            pack.slots.append(blocks[pos // bs] * bs + pos % bs)
            pack.positions.append(pos)
            pack.tables.append(blocks[: -(-(c + n) // bs)])
            as_rows = n <= self.row_prefill_max
            meta.prefills.append(PrefillSeq(q_start, n, c, as_rows=as_rows))
            if as_rows:
                meta.row_prefill_chunks += 1
                meta.row_prefill_tokens += n
            q_start += n
        meta.varlen = self._varlen(meta.prefills, pack.tables, q_start - first)

    def _varlen(self, seqs: list[PrefillSeq], tables: list[np.ndarray], num_tokens: int) -> VarlenPrefill:
        """The chunks' lengths and one block table, sent to the device in a single copy."""
        n = len(seqs)
        q_lens = np.fromiter((s.q_len for s in seqs), dtype=np.int64, count=n)
        k_lens = q_lens + np.fromiter((s.ctx_len for s in seqs), dtype=np.int64, count=n)
        width = max(len(t) for t in tables)
        # One int32 buffer: cu_seqlens_q [n + 1], cu_seqlens_k [n + 1], seq_lens_k [n], table [n, width].
        buf = np.zeros(3 * n + 2 + n * width, dtype=np.int64)
        np.cumsum(q_lens, out=buf[1 : n + 1])
        np.cumsum(k_lens, out=buf[n + 2 : 2 * n + 2])
        buf[2 * n + 2 : 3 * n + 2] = k_lens
        table = buf[3 * n + 2 :].reshape(n, width)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = blocks
        self._check_blocks(table)
        dev = self._to_device(buf, torch.int32)
        return VarlenPrefill(
            cu_seqlens_q=dev[: n + 1],
            cu_seqlens_k=dev[n + 1 : 2 * n + 2],
            seq_lens_k=dev[2 * n + 2 : 3 * n + 2],
            block_table=dev[3 * n + 2 :].view(n, width),
            max_q_len=int(q_lens.max()),
            max_k_len=int(k_lens.max()),
            num_tokens=num_tokens,
        )

    def _row_prefill_meta(
        self, tables: list[np.ndarray], positions: np.ndarray, meta: AttentionMetadata
    ) -> None:
        """Decode-row metadata of the leading ``row_prefill_chunks`` chunks: each query token is a
        row over its chunk's blocks, as long as its position plus one."""
        lo = meta.num_decode
        rows = meta.prefills[: meta.row_prefill_chunks]
        lens = positions[lo : lo + meta.row_prefill_tokens] + 1  # each token sees its prefix and itself
        table = np.zeros((len(lens), max(len(t) for t in tables)), dtype=np.int64)
        at = 0
        for seq, blocks in zip(rows, tables):
            table[at : at + seq.q_len, : len(blocks)] = blocks
            at += seq.q_len
        meta.row_prefill_table = self._to_device(table, torch.int32)
        meta.row_prefill_lens = self._to_device(lens, torch.int32)
        meta.row_prefill_max_len = int(lens.max())


@dataclass
class _Packing:
    """Per-chunk arrays of one step, concatenated at the end."""

    tokens: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    tables: list[np.ndarray] = field(default_factory=list)  # per prefill chunk: the blocks it reads


def _logits_rows(
    order: list[tuple[Request, int]],
) -> tuple[np.ndarray, list[Request], list[PromptLogprobRows], int]:
    """Rows for the LM head: prompt-logprob rows first, then one row per sampling sequence."""
    prompt_rows: list[PromptLogprobRows] = []
    prompt_idx: list[np.ndarray] = []
    sample_idx: list[int] = []
    sample_requests: list[Request] = []
    start = 0
    num_prompt_rows = 0
    for r, n in order:
        c = r.num_computed_tokens
        if r.prompt_logprobs is not None:
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
    rows = np.concatenate([*prompt_idx, np.asarray(sample_idx, dtype=np.int64)]).astype(np.int64)
    return rows, sample_requests, prompt_rows, num_prompt_rows
