"""Scratch tensors for the sampler, reused between steps on the CPU."""

from __future__ import annotations

import torch

from cbgen.sample.row_ops import cpu_chunk_rows


class Workspace:
    """Named float32 buffers of one sampler (not thread-safe: a buffer is reused by the next step)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """An uninitialised float32 ``[rows, cols]`` tensor; on CPU the storage of ``name`` is reused."""
        # On CPU a fresh [B, V] float32 tensor is an mmap plus page faults on every step (it is
        # over glibc's mmap threshold), which costs as much as the math; reuse one buffer instead.
        # Accelerators have caching allocators, so we do not pin memory there.
        if device.type != "cpu":
            return torch.empty((rows, cols), dtype=torch.float32, device=device)
        need = rows * cols
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=torch.float32)
            self._buffers[name] = buf
        return buf[:need].view(rows, cols)

    def scratch(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """The chunk buffer of the exp passes (:func:`~cbgen.sample.row_ops.exp_sum` and friends)."""
        # Chunked on CPU so a chunk stays in cache across its passes; one chunk on accelerators.
        return self.buffer(
            "scratch", min(rows, cpu_chunk_rows(vocab)) if device.type == "cpu" else rows, vocab, device
        )


__all__ = ["Workspace"]
