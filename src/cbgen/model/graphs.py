"""Decode steps on static buffers, padded to buckets; captured as CUDA graphs on CUDA.

A decode-only step (every row has one new token) is copied into preallocated buffers padded up to
a batch bucket.  On CUDA each bucket's forward is captured once as a CUDA graph, all graphs in
one shared memory pool, largest first (later, smaller captures reuse the pool's blocks), and
replayed afterwards.  On CPU the same padded path runs eagerly or through ``torch.compile``, which
is how CI exercises the padding and bucketing logic.

Rules that keep this from giving silently wrong answers (transformers#45323):

* :class:`GraphKey` holds every Python value baked into a capture: batch bucket, block-table width
  (the torch backend gathers a fixed ``width * block_size`` keys), block size, dtype and the
  attention backend.  A step only replays a graph whose key equals its own.
* Padding rows never write the cache: their slot is ``-1`` for the kernel backends' stores, or a
  reserved scratch block for the torch store (no data-dependent filtering inside a graph); see
  :meth:`cbgen.model.attention.AttentionBackend.pad_slot`.
* Padding rows are never sampled: only the first ``B`` rows of the logits are returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cbgen.model.attention import AttentionBackend, AttentionMetadata
from cbgen.model.input_batch import ModelInput

logger = logging.getLogger("cbgen")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (which is always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    buckets.append(max_batch)
    return sorted(set(buckets))


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``n`` rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch of {n} exceeds the largest bucket {buckets[-1]}")


def width_bucket(blocks: int, max_width: int) -> int:
    """Block-table width for a step: the next power of two (at least 4), capped at ``max_width``."""
    width = 4
    while width < blocks:
        width *= 2
    return min(width, max_width)


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured decode forward depends on besides buffer contents."""

    batch: int
    width: int
    block_size: int
    dtype: torch.dtype
    backend: str  # the attention backend's name


class StaticDecodeRunner:
    """Runs decode-only batches through fixed-shape buffers (see module docstring)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        kv_layers: Callable[[], list],
        block_size: int,
        max_batch: int,
        max_width: int,
        device: torch.device,
        dtype: torch.dtype,
        scratch_slot: int,
        backend: AttentionBackend,
        use_cuda_graphs: bool = False,
    ) -> None:
        self.forward = forward
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_width = max_width
        self.device = device
        self.dtype = dtype
        # A capture cannot contain a host sync: the torch reference's variant stores every slot,
        # padding rows included (they write to the scratch block, see pad_slot).
        self.backend = backend.fixed_shape()
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        # Kernel stores skip slot -1; the torch store must write somewhere harmless instead.
        self.pad_slot = backend.pad_slot(scratch_slot)
        # With a paged kernel the block-table width is not baked into the graph (the kernel reads
        # seq_lens), so one width serves every step and the graph count stays at one per bucket.
        self.fixed_width = backend.paged_decode
        self.graphs: dict[GraphKey, tuple[object, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self._alloc_buffers()

    def _alloc_buffers(self) -> None:
        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, self.max_width, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)

    def release(self) -> None:
        """Drops every graph, the pool and the buffers (so their memory returns to the allocator)."""
        self.graphs.clear()
        self.pool = None
        for name in ("input_ids", "positions", "slots", "seq_lens", "block_table", "rows"):
            setattr(self, name, None)

    def resume(self) -> None:
        """Re-creates the buffers after :meth:`release`; graphs are captured again on demand."""
        if self.input_ids is None:
            self._alloc_buffers()

    def can_run(self, batch: ModelInput) -> bool:
        """Decode-only, no prompt-logprob rows, one sampled row per sequence, and within the buffers."""
        meta = batch.meta
        return (
            not meta.prefills
            and batch.num_prompt_rows == 0
            and len(batch.sample_requests) == meta.num_decode
            and meta.num_decode <= self.max_batch
            and meta.decode_block_table is not None
            and meta.decode_block_table.shape[1] <= self.max_width
        )

    def key_for(self, num_rows: int, table_width: int) -> GraphKey:
        """The graph key of a step with ``num_rows`` rows and a ``table_width``-block table."""
        width = self.max_width if self.fixed_width else width_bucket(table_width, self.max_width)
        return GraphKey(
            bucket_for(num_rows, self.buckets), width, self.block_size, self.dtype, self.backend.name
        )

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        n = key.batch
        return AttentionMetadata(
            kv_caches=self.kv_layers(),
            slot_mapping=self.slots[:n],
            num_decode=n,
            decode_block_table=self.block_table[:n, : key.width],
            decode_seq_lens=self.seq_lens[:n],
            decode_max_len=key.width * self.block_size,
            prefills=[],
            backend=self.backend,
        )

    def _run_forward(self, key: GraphKey) -> torch.Tensor:
        n = key.batch
        return self.forward(self.input_ids[:n], self.positions[:n], self.rows[:n], self._meta(key))

    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits ``[B, V]`` for a decode-only batch, computed on the padded static path."""
        meta = batch.meta
        b = meta.num_decode
        table = meta.decode_block_table
        key = self.key_for(b, table.shape[1])
        n = key.batch
        # Fill the live rows and reset the padding rows: stale values there would write into
        # (or read from) blocks that now belong to other sequences.
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slots[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.decode_seq_lens, non_blocking=True)
        w = min(table.shape[1], key.width)
        self.block_table[:b, :w].copy_(table[:, :w], non_blocking=True)
        if w < key.width:
            self.block_table[:b, w : key.width].zero_()
        if n > b:
            self.input_ids[b:n].zero_()
            self.positions[b:n].zero_()
            self.slots[b:n].fill_(self.pad_slot)
            self.seq_lens[b:n].fill_(1 if self.pad_slot != -1 else 0)
            self.block_table[b:n, : key.width].fill_(
                self.pad_slot // self.block_size if self.pad_slot >= 0 else 0
            )

        if self.use_cuda_graphs:
            entry = self.graphs.get(key)
            if entry is None:
                entry = self._capture(key)
            graph, out = entry
            graph.replay()
            self.replays += 1
            return out[:b]
        return self._run_forward(key)[:b]

    def _capture(self, key: GraphKey) -> tuple[object, torch.Tensor]:
        """Captures one bucket (warm-up on a side stream first, as CUDA graphs require)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run_forward(key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run_forward(key)
        self.graphs[key] = (graph, out)
        logger.debug("captured decode graph %s", key)
        return graph, out

    def capture_all(self) -> None:
        """Captures every batch bucket up front, largest first, so smaller graphs share the pool."""
        if not self.use_cuda_graphs:
            return
        width = self.max_width if self.fixed_width else width_bucket(1, self.max_width)
        # A valid state for warm-up: every row attends to one token in the scratch block.
        for n in sorted(self.buckets, reverse=True):
            key = GraphKey(n, width, self.block_size, self.dtype, self.backend.name)
            if key in self.graphs:
                continue
            self.slots[:n].fill_(self.pad_slot)
            self.seq_lens[:n].fill_(1)
            self.block_table[:n].zero_()
            self._capture(key)
        logger.info("captured %d decode CUDA graphs (batch buckets %s)", len(self.graphs), self.buckets)
