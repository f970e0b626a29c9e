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

The engine does not branch on any of this: it composes a :class:`StepSync`, the hooks it calls where
a group must decide as one (an add, an abort, the start of a step, the schedule, the sample).  A
rank alone gets :class:`Solo`, whose hooks decide locally; a tensor-parallel rank gets
:class:`GroupSync`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from cbgen.topology import Topology


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


class StepSync(Protocol):
    """The hooks an engine step calls where a tensor-parallel group must decide as one."""

    @property
    def active(self) -> bool:
        """Whether this rank steps in lockstep with others (tensor parallelism)."""
        ...

    @property
    def is_root(self) -> bool:
        """Whether this rank's decisions count (always, for a rank alone)."""
        ...

    @property
    def following(self) -> bool:
        """Whether :meth:`cbgen.engine.Engine.follow` should run another step."""
        ...

    def reserves(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken by an add not queued yet (it waits for the root's copy)."""
        ...

    def has_pending(self) -> bool:
        """Whether adds are waiting for the root's copy (the engine is not idle yet)."""
        ...

    def on_add(
        self, request_id: str, prompt_token_ids: list[int], params: Any, prompt: Any, stream: bool
    ) -> bool:
        """Records an add; True when the engine queues it now."""
        ...

    def on_abort(self, request_id: str) -> bool:
        """Records an abort; True when the engine aborts now."""
        ...

    def begin_step(
        self,
        weights_changed: Callable[[], bool],
        queue: Callable[..., None],
        abort: Callable[[str], Any],
    ) -> tuple[bool, list]:
        """Before a step: whether the weights changed (the group's decision), and outputs the step
        returns ahead of its own (of aborts made here)."""
        ...

    def check_schedule(self, scheduled: list) -> None:
        """Raises if this rank scheduled differently from the group."""
        ...

    def sample(self, draw: Callable[[], Any]) -> tuple[Any, Any]:
        """The step's sample: ``(draw()'s output or None, the host tokens every rank applies or None)``."""
        ...

    def request_stop(self) -> bool:
        """Root: ends the followers' loops with the next step; False where there is nothing to stop."""
        ...


class Solo:
    """:class:`StepSync` of a rank alone: every decision is its own, nothing is exchanged."""

    active = False
    is_root = True
    following = False

    def reserves(self, request_id: str) -> bool:
        """Nothing waits for a root."""
        return False

    def has_pending(self) -> bool:
        """Nothing waits for a root."""
        return False

    def on_add(
        self, request_id: str, prompt_token_ids: list[int], params: Any, prompt: Any, stream: bool
    ) -> bool:
        """Queued at once."""
        return True

    def on_abort(self, request_id: str) -> bool:
        """Aborted at once."""
        return True

    def begin_step(
        self,
        weights_changed: Callable[[], bool],
        queue: Callable[..., None],
        abort: Callable[[str], Any],
    ) -> tuple[bool, list]:
        """This rank's own weight check; no outputs ahead."""
        return weights_changed(), []

    def check_schedule(self, scheduled: list) -> None:
        """No group to agree with."""

    def sample(self, draw: Callable[[], Any]) -> tuple[Any, Any]:
        """This rank's own draw, read back by the engine when it applies it."""
        return draw(), None

    def request_stop(self) -> bool:
        """No followers."""
        return False


def step_sync(topology: Topology, timeout_s: float) -> StepSync:
    """The :class:`StepSync` of a rank: :class:`GroupSync` in a tensor-parallel group, else :class:`Solo`."""
    if topology.tp_size > 1:
        return GroupSync(Lockstep(topology, timeout_s))
    return Solo()


class GroupSync:
    """The engine's side of the lockstep: what its rank records between steps, and the exchanges.

    The root records its adds and aborts (they go out with the next step); a follower records its
    own adds only to check them against the root's (an SPMD program adds the same requests), and
    never queues anything the root did not send."""

    active = True

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep = lockstep
        self.ingress = Ingress()  # root: what the group learns at the next step
        self.expected: dict[str, tuple] = {}  # follower: local adds the root must confirm
        self.stopped = False  # follower: the root said stop
        self.abort_outputs: list = []  # follower: outputs of the root's aborts, returned by this step

    @property
    def is_root(self) -> bool:
        """Whether this rank decides for the group."""
        return self.lockstep.is_root

    @property
    def following(self) -> bool:
        """Until the root says stop (the root itself never stops following)."""
        return not self.stopped

    def reserves(self, request_id: str) -> bool:
        """Follower: a local add waits for the root's copy under this id."""
        return request_id in self.expected

    def has_pending(self) -> bool:
        """Follower: local adds the root has not sent yet."""
        return bool(self.expected)

    def on_add(
        self, request_id: str, prompt_token_ids: list[int], params: Any, prompt: Any, stream: bool
    ) -> bool:
        """Records an add; True when this rank queues it now (the root), False when it waits for
        the root's copy (a follower)."""
        if not self.is_root:
            self.expected[request_id] = (prompt_token_ids, params)
            return False
        self.ingress.adds.append((request_id, prompt_token_ids, params, prompt, stream))
        return True

    def on_abort(self, request_id: str) -> bool:
        """Records an abort; True when this rank aborts now (only the root's aborts count)."""
        if self.is_root:
            self.ingress.aborts.append(request_id)
        return self.is_root

    def exchange(
        self,
        weights_changed: Callable[[], bool],
        queue: Callable[..., None],
        abort: Callable[[str], Any],
    ) -> bool:
        """The exchange before a step: the root sends its adds, aborts and weight decision; a
        follower queues and aborts as told (checking its own adds) and returns the root's decision."""
        if self.is_root:
            ingress, self.ingress = self.ingress, Ingress()
            ingress.weights_changed = weights_changed()
            self.lockstep.share(ingress)
            return ingress.weights_changed
        ingress: Ingress = self.lockstep.share()
        rank = self.lockstep.topology.rank
        for request_id, prompt_token_ids, params, prompt, stream in ingress.adds:
            mine = self.expected.pop(request_id, None)
            if mine is not None and mine != (prompt_token_ids, params):
                raise RuntimeError(
                    f"rank {rank} added {request_id!r} with other tokens or params than the root"
                )
            queue(request_id, prompt_token_ids, params, prompt, stream)
        if self.expected:
            raise RuntimeError(
                f"rank {rank} added requests the root did not: {sorted(self.expected)[:5]} (every rank "
                "of a tensor-parallel group must add the same requests, or only the root)"
            )
        for request_id in ingress.aborts:
            out = abort(request_id)
            if out is not None:
                self.abort_outputs.append(out)  # returned by this step, as the root's abort() returned it
        self.stopped = ingress.stop
        weights_changed()  # keep this rank's fingerprint current; the root's decision counts
        return ingress.weights_changed

    def begin_step(
        self,
        weights_changed: Callable[[], bool],
        queue: Callable[..., None],
        abort: Callable[[str], Any],
    ) -> tuple[bool, list]:
        """:meth:`exchange`, and the outputs of the root's aborts this rank just carried out (a
        follower returns them from this step, as the root's ``abort()`` returned them)."""
        changed = self.exchange(weights_changed, queue, abort)
        outputs, self.abort_outputs = self.abort_outputs, []
        return changed, outputs

    def check_schedule(self, scheduled: list) -> None:
        """Before any collective of the forward: ranks that would run different steps stop here."""
        digest = schedule_digest(scheduled)
        self.lockstep.check_digest(self.lockstep.share(digest), digest)

    def share_sample(self, host: Any) -> Any:
        """The root's sampled tokens (``host``, on the root) on every rank: one draw for the group."""
        return self.lockstep.share(host if self.is_root else None)

    def sample(self, draw: Callable[[], Any]) -> tuple[Any, Any]:
        """Only the root draws; every rank applies the root's tokens, whatever the last bits of the
        ranks' logits."""
        sampled = draw() if self.is_root else None
        return sampled, self.share_sample(sampled.to_host() if sampled is not None else None)

    def request_stop(self) -> bool:
        """Root: the next exchange tells the followers to stop."""
        if not self.is_root:
            return False
        self.ingress.stop = True
        return True
