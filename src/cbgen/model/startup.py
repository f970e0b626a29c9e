"""What the engine's start-up checks run on: the few parts of one engine they read, typed.

The checks (:func:`cbgen.model.support.probe` and :func:`cbgen.model.support.check_direct_forward`)
run the engine's own forward on two short sequences before the first request.  They take this
narrow view, which the engine builds once its runner exists, rather than the engine itself: the
model layer then needs nothing of ``cbgen.engine`` (which sits above it), and what the checks read
is written here, where a type checker and ``tests/test_layering.py`` can see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cbgen.model.kv_cache import KVCache
    from cbgen.model.plan import ExecutionPlan
    from cbgen.model.runner import ModelRunner


@dataclass(frozen=True)
class StartupTarget:
    """One engine's forward as its start-up checks drive it: the runner and the KV cache it
    writes, and the facts about the model the checks size and compare their steps by."""

    runner: ModelRunner
    kv_cache: KVCache
    model: torch.nn.Module
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    # Whether the engine's input builder records per-token rotary extents (the model's rotary
    # switches with the length): the checks build their steps as the engine does.
    rope_extents: bool

    @property
    def plan(self) -> ExecutionPlan:
        """The plan in force: read from the runner each time, since a change of the model's
        structure (the probe's layer hooks, for one) makes the runner re-plan."""
        return self.runner.plan
