"""Jobs, pauses and the fair policy: who a step serves first when the scheduler is fair.

Pausing: a paused group (the async front end pauses a stream whose reader fell behind) is preempted
at the next schedule, keeping every token it generated, and is not admitted again until resumed.

Fairness (opt-in: ``Scheduler.fairness``; the server turns it on).  First come, first served lets one
huge request hold every seat, block and token of the budget for as long as it generates.  With a
:class:`Fairness` policy, groups belong to *jobs* (a job is one group unless :meth:`Jobs.set_job`
puts several in one, e.g. the prompts of one HTTP request) and jobs are served least attained service
first (service: the tokens computed for a job, and the prompt tokens it found in the prefix cache),
for the budget and for admission alike.  A job is *young* until it has computed
``Fairness.quantum`` tokens, *old* after.  A young job that lacks a seat or blocks preempts the
newest sequences of the most-served old jobs.  While young jobs compute, old jobs get
``Fairness.old_share`` tokens per young token, counted over those steps (a credit: with a share of
1/4 and one young decode row per step, one old row every fourth step), and only decode rows while the
young jobs decode (a prefill chunk would take a decode step off its fast path: fused CPU kernels,
CUDA graphs).  So a small request waits for at most the step in progress, then gets its first token
after its own prefill, in steps that cost about what they would alone (at most ``1 + old_share``
times, where a step's cost grows with its tokens), whatever the size or length of the old work.
Old work never waits for young work that is blocked, and gets the whole budget once no young job
computes; young work is bounded (``quantum`` tokens per job), so old jobs always progress.

The policy decides the order; the :class:`~cbgen.core.scheduler.Scheduler` hands out budget, seats
and blocks (:class:`StepBuilder` is what the policy needs of it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cbgen.request import Request

if TYPE_CHECKING:
    from cbgen.core.scheduler import SchedulerOutput

RequestFilter = Callable[[Request], bool]


@dataclass
class Fairness:
    """How a fair scheduler shares steps between jobs (see the module docstring).

    ``quantum``: tokens a job computes while it is young.  ``old_share``: while young jobs compute, old
    jobs get this many tokens per young token (None: no cap, which suits devices where a bigger step
    costs little more).
    """

    quantum: int = 512
    # A quarter: on a CPU, one more decode row can cost most of what the first one does.
    old_share: float | None = 0.25

    def __post_init__(self) -> None:
        if self.quantum < 0:
            raise ValueError(f"Fairness.quantum must be >= 0, got {self.quantum!r}")
        if self.old_share is not None and not self.old_share > 0:
            raise ValueError(f"Fairness.old_share must be > 0 or None, got {self.old_share!r}")


class StepBuilder(Protocol):
    """The scheduler as the policy drives it: its queues, and the operations that hand out a step's
    budget, seats and blocks (see :class:`~cbgen.core.scheduler.Scheduler`)."""

    running: list[Request]
    waiting: deque[Request]
    max_num_batched_tokens: int

    def preempt(self, request: Request, out: SchedulerOutput) -> None: ...

    def serve_running(
        self, out: SchedulerOutput, budget: int, wanted: RequestFilter | None = None
    ) -> tuple[int, list[Request]]: ...

    def admit(
        self,
        out: SchedulerOutput,
        budget: int,
        wanted: RequestFilter | None = None,
        evict: RequestFilter | None = None,
    ) -> int: ...


class Jobs:
    """Which job each group belongs to, the service each job has had, the paused groups, and (with a
    :class:`Fairness`) the fair order of a step."""

    def __init__(self, fairness: Fairness | None = None) -> None:
        self.fairness = fairness
        self.paused: set[str] = set()  # group ids
        self._job_of: dict[str, str] = {}  # group id -> job, where set_job said so
        self._job_groups: dict[str, int] = {}  # job -> groups set_job put in it and not released
        self._served: dict[str, int] = {}  # job -> tokens scheduled for it so far
        self._old_credit = 0.0  # tokens old jobs may still add to steps with young work

    # ------------------------------------------------------------------ jobs and pauses
    def set_job(self, group_id: str, job: str) -> None:
        """Counts the group's service towards ``job`` (shared with the other groups set to it)."""
        self.release(group_id)
        self._job_of[group_id] = job
        self._job_groups[job] = self._job_groups.get(job, 0) + 1

    def release(self, group_id: str) -> None:
        """Forgets what :meth:`set_job` and :meth:`pause` recorded for a group that ended."""
        self.paused.discard(group_id)
        job = self._job_of.pop(group_id, None)
        if job is not None:
            left = self._job_groups[job] - 1
            if left:
                self._job_groups[job] = left
            else:
                del self._job_groups[job]
                self._served.pop(job, None)

    def pause(self, group_id: str) -> None:
        """Stops scheduling the group: it is preempted at the next schedule and waits until resumed."""
        self.paused.add(group_id)

    def resume(self, group_id: str) -> None:
        """Lets a paused group be admitted again (it recomputes what its preemption dropped)."""
        self.paused.discard(group_id)

    def job(self, request: Request) -> str:
        """The job ``request`` belongs to: what :meth:`set_job` said, else its own group."""
        return self._job_of.get(request.group_id, request.group_id)

    def served(self, request: Request) -> int:
        """Tokens scheduled so far for the job ``request`` belongs to."""
        return self._served.get(self.job(request), 0)

    def is_young(self, request: Request) -> bool:
        """Whether the request's job has computed fewer than ``fairness.quantum`` tokens (never
        without a fairness policy)."""
        return self.fairness is not None and self.served(request) < self.fairness.quantum

    def is_old(self, request: Request) -> bool:
        """The opposite of :meth:`is_young`."""
        return not self.is_young(request)

    # ------------------------------------------------------------------ service
    def charge(
        self, scheduled: list[tuple[Request, int]], running: Collection[Request], waiting: Collection[Request]
    ) -> None:
        """Counts a step's scheduled tokens as service of their jobs; ``running`` and ``waiting`` are
        the live requests, whose jobs' records are kept."""
        served = self._served
        for request, n in scheduled:
            job = self.job(request)
            served[job] = served.get(job, 0) + n
        # Groups nobody released (no set_job) leave entries behind: drop those of jobs that are gone.
        if len(served) > 2 * (len(running) + len(waiting)) + 64:
            live = {self.job(r) for r in (*running, *waiting)}
            self._served = {job: n for job, n in served.items() if job in live or job in self._job_groups}

    def charge_cached(self, request: Request, num_cached_tokens: int) -> None:
        """Counts the prompt tokens a newly admitted request found in the prefix cache as service
        (fair only): a job cannot stay young, and uncapped, by sending prompts it knows are cached."""
        if self.fairness is not None and num_cached_tokens:
            job = self.job(request)
            self._served[job] = self._served.get(job, 0) + num_cached_tokens

    @property
    def old_credit(self) -> float:
        """Tokens old jobs may still add to steps with young work (0 while no young job computes)."""
        return self._old_credit

    def admission_order(self, candidates: list[Request]) -> list[Request]:
        """Waiting requests in the order they are admitted: arrival order, least served job first
        when fair (stable, so a job's requests keep their arrival order)."""
        if self.fairness is not None:
            candidates.sort(key=self.served)
        return candidates

    # ------------------------------------------------------------------ the step
    def preempt_paused(self, steps: StepBuilder, out: SchedulerOutput) -> None:
        """Preempts the running sequences of paused groups; they are requeued at the front, in their
        running order."""
        paused = [r for r in steps.running if r.group_id in self.paused]
        if paused:
            steps.running = [r for r in steps.running if r.group_id not in self.paused]
            for request in reversed(paused):
                steps.preempt(request, out)

    def schedule_fair(self, steps: StepBuilder, out: SchedulerOutput) -> None:
        """Young jobs first (running or waiting, least attained service first; admitted by evicting old
        work), then old jobs within their share of the step (see the module docstring)."""
        young, old, served = self.is_young, self.is_old, self.served
        before = len(out.preempted)  # the paused, preempted already
        steps.running.sort(key=served)  # stable: each job's sequences stay in admission order
        # A running young job that has had more service than a waiting one goes after its admission.
        waiting = [served(r) for r in steps.waiting if r.group_id not in self.paused and young(r)]
        cut = min(waiting, default=math.inf)
        budget, victims = steps.serve_running(
            out, steps.max_num_batched_tokens, lambda r: young(r) and served(r) <= cut
        )
        if not any(young(v) for v in victims):
            budget = steps.admit(out, budget, young, evict=old)
        budget, _ = steps.serve_running(out, budget, young)
        budget, capped = self._old_budget(out.num_tokens, budget, steps.max_num_batched_tokens)
        # A step of decode rows only takes the fast path (fused CPU kernels, CUDA graphs): old work
        # must not turn young decoding into a mixed step with a prefill chunk.
        decoding = out.num_tokens > 0 and all(n == 1 and _decode_row(r) for r, n in out.scheduled)
        old_wanted = (lambda r: old(r) and _decode_row(r)) if decoding else old
        left, _ = steps.serve_running(out, budget, old_wanted)
        if len(out.preempted) == before and not decoding:  # old work is admitted only in steps
            left = steps.admit(out, left, old)  # that preempted nothing
        if capped:
            self._old_credit -= budget - left

    def _old_budget(self, young_tokens: int, budget: int, max_budget: int) -> tuple[int, bool]:
        """The budget old work may use after ``young_tokens`` young tokens, and whether the credit
        capped it: old work earns ``old_share`` per young token, carried over steps with young work."""
        share = self.fairness.old_share if self.fairness is not None else None
        if share is None or young_tokens <= 0:
            self._old_credit = 0.0
            return budget, False
        self._old_credit = min(self._old_credit + share * young_tokens, float(max_budget))
        return min(budget, int(self._old_credit)), True


def _decode_row(request: Request) -> bool:
    """Whether computing the request's next tokens is one decode row (one token left to compute)."""
    return request.num_tokens - request.num_computed_tokens <= 1
