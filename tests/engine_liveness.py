"""Holds every sequence of a real engine to the liveness bound of docs/design.md ("Scheduling and the
liveness bound"), per sequence, counted from the step that first scheduled it.

With first come, first served scheduling a sequence ends within ``sum of (p + m + 1) + 2`` steps of
its first scheduling, the sum over the sequences live at some point in between.  A weight change
restarts what is in flight, so a sequence's window starts no earlier than the step after the last
weight change.  ``tests/core/sched_driver.py`` asserts the same on the scheduler alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cbgen.core.update import sampling_sequences


@dataclass
class SeqRecord:
    """One sequence (one sample of a request) as the watch saw it; steps are numbered from 1."""

    cost: int  # its share of the bound: p + m + 1
    added_at: int  # steps run before it was added
    first_at: int | None = None  # the step that first scheduled it
    ended_at: int | None = None  # the step in (or after) which it ended; None while live


def window_bound(records: Mapping[Any, SeqRecord], start: int, end: int) -> int:
    """The bound over steps ``start..end``: the sequences that took part in one of them."""
    live = [r for r in records.values() if r.added_at < end and (r.ended_at is None or r.ended_at >= start)]
    return sum(r.cost for r in live) + 2


def check_end(records: Mapping[Any, SeqRecord], key: Any, restart_at: int) -> None:
    """Asserts that sequence ``key`` (``ended_at`` set) ended within the bound counted from its first
    scheduling, or from the step after the last weight change (``restart_at`` steps run) if later."""
    rec = records[key]
    if rec.first_at is None or rec.ended_at is None:
        return  # never scheduled (aborted or refused while waiting): no step to count from
    start = max(rec.first_at, restart_at + 1)
    took, bound = rec.ended_at - start + 1, window_bound(records, start, rec.ended_at)
    assert took <= bound, f"{key} took {took} steps from step {start}, bound {bound}"


class LivenessWatch:
    """Wraps one engine: call :meth:`added` after ``add_request``, :meth:`step` instead of
    ``engine.step``, :meth:`weights_changed` after a weight change and :meth:`settle` after an abort.
    Every sequence is checked as it ends."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps = 0
        self.restart_at = 0
        self.records: dict[int, SeqRecord] = {}
        self.requests: dict[int, Any] = {}  # id(request) -> request, for the sequences watched
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            # The step that launches this schedule is the one running now (with overlap scheduling
            # it may be the next: one step early, which only makes the check stricter).
            for r, n in out.scheduled:
                for seq in [r, *sampling_sequences(r, n)]:  # forked followers start with their leader
                    rec = self.records.get(id(seq))
                    if rec is not None and rec.first_at is None:
                        rec.first_at = self.steps
            return out

        engine.scheduler.schedule = recording_schedule

    def added(self, request_id: str, params: Any) -> None:
        """Starts watching the samples of request ``request_id``."""
        for sample in self.engine.groups[request_id].samples:
            cost = sample.num_prompt_tokens + params.max_tokens + 1
            self.records[id(sample)] = SeqRecord(cost, self.steps)
            self.requests[id(sample)] = sample

    def step(self) -> list:
        """One engine step, then the bound for every sequence that ended in it."""
        self.steps += 1
        outputs = self.engine.step()
        self.settle()
        return outputs

    def weights_changed(self) -> None:
        """After the engine applied a weight change: windows restart from the next step.  Sequences
        that ended in the change (their in-flight tokens applied) are checked under the old window."""
        self.settle()
        self.restart_at = self.steps

    def settle(self) -> None:
        """Records ends (checking each) and restarts (an n>1 group restarts finished samples)."""
        for key, request in self.requests.items():
            rec = self.records[key]
            if request.is_finished and rec.ended_at is None:
                rec.ended_at = self.steps
                check_end(self.records, key, self.restart_at)
            elif not request.is_finished and rec.ended_at is not None:
                rec.ended_at = None
                rec.first_at = None
