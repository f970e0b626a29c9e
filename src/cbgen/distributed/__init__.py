"""Running cbgen on more than one device, on engines users already have.

* Tensor parallelism is transformers' own (a model loaded with ``tp_plan="auto"`` or sharded in
  memory with its tensor-parallel API); cbgen caches each rank's heads and keeps the ranks of a
  group in lockstep (:mod:`cbgen.lockstep`, which the engine composes).
* Data parallelism is one engine per rank under ``torch.distributed``
  (:func:`cbgen.distributed.generate_dp`).
* Fleets outside a trainer are Ray actors (:class:`cbgen.distributed.EnginePool`, extra ``ray``).

This package is a way in, above :class:`cbgen.LLM` (docs/design.md, "The shape").  Where a process
sits among the ranks is the leaf module :mod:`cbgen.topology`, read by every layer; its names are
re-exported here.  See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

from cbgen.distributed.dp import generate_dp
from cbgen.topology import Topology, topology_of

__all__ = ["EnginePool", "Topology", "generate_dp", "topology_of"]


def __getattr__(name: str) -> Any:
    # Ray is an optional extra: importing cbgen.distributed must not need it.
    if name == "EnginePool":
        from cbgen.distributed.ray_pool import EnginePool

        return EnginePool
    raise AttributeError(name)
