"""Helpers the in-process runners share: device sync, peak memory and warm-up prompts."""

from __future__ import annotations

import resource
from typing import Any


def peak_memory(device: Any) -> tuple[int, str]:
    """Peak bytes so far and their kind: CUDA allocations on a CUDA device, else this process's RSS."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


def reset_peak(device: Any) -> None:
    """Restarts the CUDA peak-memory counter (RSS peaks cannot be reset)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def sync(device: Any) -> None:
    """Waits for queued CUDA work, so a timer stopped next measures it."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: Any) -> Any:
    """The device of the model's first parameter."""
    return next(model.parameters()).device


def warmup_prompts(vocab_size: int) -> list[list[int]]:
    """Two short untimed warm-up prompts."""
    # Ids near the top of the vocabulary: no workload prompt starts with them, so a warm-up never
    # seeds a prefix cache that the timed run could hit.
    top = vocab_size - 1
    return [[top - (i % 7) for i in range(24)], [top - 1 - (i % 5) for i in range(9)]]


__all__ = ["model_device", "peak_memory", "reset_peak", "sync", "warmup_prompts"]
