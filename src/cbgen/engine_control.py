"""What a front end may do with an engine besides adding, stepping and aborting.

:class:`~cbgen.async_engine.AsyncEngine` and the server pause the requests of slow readers, group
requests into fairness jobs, report queue and cache gauges, and ask whether a step has anything to
do.  They do it through :class:`EngineControl`, so the scheduler, the block manager and the step in
flight stay the engine's own business (and can be reorganised behind it).  Not thread-safe, like the
engine: call it from the thread that steps the engine (or while that thread is parked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbgen.core.scheduler import Fairness

if TYPE_CHECKING:
    from cbgen.engine import Engine

__all__ = ["EngineControl", "EngineSnapshot"]


@dataclass(frozen=True)
class EngineSnapshot:
    """Queue and KV-cache gauges at one moment (for ``/metrics`` and stats)."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for admission (or preempted)
    paused: int  # requests paused (their consumer fell behind)
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    kv_usage: float  # fraction of KV blocks in use


class EngineControl:
    """The front ends' handle on one engine (``engine.control``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    # ------------------------------------------------------------------ tensor parallelism
    @property
    def lockstep(self) -> bool:
        """Whether the engine steps in lockstep with other ranks (tensor parallelism): an idle group
        must still step now and then, and only the root takes requests."""
        return self._engine.lockstep.active

    @property
    def is_follower(self) -> bool:
        """A tensor-parallel rank that only runs its root's steps (see ``Engine.follow``)."""
        return not self._engine.lockstep.is_root

    # ------------------------------------------------------------------ scheduling policy
    @property
    def fairness(self) -> Fairness | None:
        """The scheduler's policy between requests (None: first come, first served)."""
        return self._engine.scheduler.fairness

    @fairness.setter
    def fairness(self, policy: Fairness | None) -> None:
        self._engine.scheduler.fairness = policy

    def set_job(self, request_id: str, job: str) -> None:
        """Puts a request in a fairness job (requests of one job share its credit)."""
        self._engine.scheduler.set_job(request_id, job)

    def release(self, request_id: str) -> None:
        """Forgets what the scheduler kept about an ended request (its job, a pause)."""
        self._engine.scheduler.release(request_id)

    def pause(self, request_id: str) -> None:
        """Holds a request out of the batch (its tokens are kept) until :meth:`resume`."""
        self._engine.scheduler.pause(request_id)

    def resume(self, request_id: str) -> None:
        """Lets a paused request be scheduled again."""
        self._engine.scheduler.resume(request_id)

    def resume_all(self) -> None:
        """Resumes every paused request (a shutdown lets them run to their end)."""
        scheduler = self._engine.scheduler
        for request_id in list(scheduler.paused):
            scheduler.resume(request_id)

    # ------------------------------------------------------------------ state
    def has_runnable_work(self) -> bool:
        """Whether a step would do something: tokens in flight, or a request that is not paused."""
        engine = self._engine
        return engine.in_flight is not None or engine.scheduler.has_runnable_work()

    def snapshot(self) -> EngineSnapshot:
        """The queue and cache gauges now."""
        scheduler, blocks = self._engine.scheduler, self._engine.block_manager
        return EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            paused=len(scheduler.paused),
            num_blocks=int(blocks.num_blocks),
            num_free_blocks=int(blocks.num_free_blocks),
            num_used_blocks=int(blocks.num_used_blocks),
            kv_usage=float(blocks.usage),
        )
