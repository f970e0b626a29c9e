"""Lockstep for a tensor-parallel group: the root rank decides, the others follow.

Every rank of a tensor-parallel group runs its own engine over its shard of the model, and the
shards' collectives only line up if every rank runs the same step: the same requests, scheduled the
same way, with the same sampled tokens.  So the group's root (its lowest rank) is the only one whose
decisions count.  Twice a step it sends them to the others over a dedicated CPU (gloo) group:

* before scheduling, a :class:`Ingress`: requests added and aborted since the last step, whether
  the weights changed, whether to stop;
* after sampling, the sampled tokens (as the host lists every rank applies) and a digest of the
  schedule, which each follower compares with its own: ranks that diverged fail at once, with a
  clear error, instead of deadlocking in a collective later.

Followers in an SPMD program (every rank calls ``LLM.generate`` with the same prompts) still add
their requests locally: the engine checks them against the root's instead of queueing them.  A rank
that dies or stops answering makes the others' next exchange time out (``timeout_s``) with an error
that says so, rather than hang.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from cbgen.distributed.topology import Topology


@dataclass
class Ingress:
    """What the root tells its group before a step."""

    adds: list[tuple] = field(default_factory=list)  # (request id, token ids, params, prompt, stream)
    aborts: list[str] = field(default_factory=list)
    weights_changed: bool = False
    stop: bool = False


def schedule_digest(scheduled: list) -> int:
    """A digest of a step's schedule that is equal on every rank that scheduled the same way
    (``hash()`` of strings differs between processes, hence crc32)."""
    text = ";".join(f"{r.request_id}:{n}" for r, n in scheduled)
    return zlib.crc32(text.encode())


class Lockstep:
    """The root-to-group channel of one tensor-parallel group (see the module docstring)."""

    def __init__(self, topology: Topology, timeout_s: float = 600.0) -> None:
        dist = torch.distributed
        self.topology = topology
        self.timeout_s = timeout_s
        self.root = topology.tp_ranks[0]
        self.is_root = topology.is_tp_root
        ranks = list(topology.tp_ranks)
        # Its own gloo group: CPU objects whatever the model's backend, and its own timeout.
        self.group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
            use_local_synchronization=len(ranks) < topology.world_size,
        )

    def share(self, value: Any = None) -> Any:
        """The root's ``value``, on every rank of the group (followers pass nothing)."""
        holder = [value if self.is_root else None]
        try:
            torch.distributed.broadcast_object_list(holder, src=self.root, group=self.group)
        except RuntimeError as exc:
            raise RuntimeError(
                f"cbgen rank {self.topology.rank}: the lockstep exchange with root rank {self.root} failed "
                f"or timed out ({self.timeout_s:.0f} s): a rank died, stopped stepping, or the ranks "
                f"diverged ({exc})"
            ) from exc
        return holder[0]

    def check_digest(self, root_digest: int, own_digest: int) -> None:
        """Raises if this rank scheduled differently from the root."""
        if root_digest != own_digest:
            raise RuntimeError(
                f"cbgen rank {self.topology.rank} diverged from root rank {self.root}: it scheduled a "
                "different step (different requests, budgets or cache state on the ranks?)"
            )

    def close(self) -> None:
        """Releases the group."""
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
