"""A stand-in for the engine's CPU thread governor (``cbgen.model.cpu_threads``) in tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class AlternatingThreads:
    """Steps alternate between 1 and 2 torch threads, and 2 are back after each; ``seen`` lists the
    count of every step."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @contextlib.contextmanager
    def governed(self) -> Iterator[int]:
        n = 1 + len(self.seen) % 2
        self.seen.append(n)
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(2)
