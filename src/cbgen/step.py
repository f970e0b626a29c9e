"""One engine step as data: the values that pass between its stages and from one step to the next.

``plan -> launch -> sample -> apply`` (see :mod:`cbgen.engine` and docs/design.md, "One step, as
data").  Each stage returns a value: the plan carries the block copies its launch performs, the
launched step carries its logits and then its sample, an application says what it changed, and a
step returns a :class:`StepResult` whose ``in_flight`` is the only thing the next step is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbgen.core.cache_pools import BlockCopy, StateCopy
from cbgen.core.scheduler import SchedulerOutput
from cbgen.core.update import SampledTokens
from cbgen.model.input_batch import ModelInput
from cbgen.outputs import RequestOutput
from cbgen.request import Request, RequestGroup
from cbgen.sample.sampler import SamplerOutput

__all__ = ["Applied", "InFlight", "LaunchedStep", "StepPlan", "StepResult", "sum_times"]

BlockCopies = list[BlockCopy | StateCopy]  # KV blocks of a cache group, or a sequence's state


@dataclass
class StepPlan:
    """A scheduled step, packed for the model but not launched."""

    sched: SchedulerOutput
    batch: ModelInput | None  # None when nothing was scheduled
    # Block copies the launch performs before the forward: copy-on-fork copies of steps applied before
    # this one was planned, then this schedule's partial prefix hits (in the order they arose).
    copies: BlockCopies = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # seconds spent scheduling and building it
    touched: list[RequestGroup] = field(default_factory=list)  # groups of requests that never fit: ended


@dataclass
class LaunchedStep:
    """A step whose forward was launched: its sampling rows' logits until sampled, then the sample."""

    batch: ModelInput
    crossed: list[Request]  # requests that completed a block (published once their tokens are known)
    logits: torch.Tensor | None = None
    sampled: SamplerOutput | None = None
    host: SampledTokens | None = None  # the sample on the host (tensor parallelism: the root's)
    # Overlap scheduling: the step scheduled and built while this one's forward ran.
    next: StepPlan | None = None
    times: dict[str, float] = field(default_factory=dict)  # forward, sample


# A launched and sampled step whose tokens are still on the device (overlap scheduling only).
InFlight = LaunchedStep


@dataclass
class Applied:
    """What applying a sampled step's tokens changed."""

    touched: list[RequestGroup] = field(default_factory=list)  # groups whose samples moved or ended
    copies: BlockCopies = field(default_factory=list)  # copy-on-fork, for the next forward to perform
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class StepResult:
    """What one step returns: its outputs, the step it leaves in flight, and what it ran."""

    outputs: list[RequestOutput]
    in_flight: InFlight | None
    plan: StepPlan  # the step launched now (an empty schedule when nothing ran)
    times: dict[str, float]  # seconds per phase spent in this call


def sum_times(*parts: dict[str, float]) -> dict[str, float]:
    """Seconds per phase summed over ``parts``, in the order the phases first ran."""
    total: dict[str, float] = {}
    for part in parts:
        for key, seconds in part.items():
            total[key] = total.get(key, 0.0) + seconds
    return total
