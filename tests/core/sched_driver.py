"""Drives the scheduler without a model, through the same :mod:`cbgen.core.update` functions the
engine runs, and holds every request to the liveness bound of docs/design.md.

The only stand-in is the model: a sampled token is a deterministic function of the sequence so far
(and of the sample index, so n>1 samples differ), so recomputed (preempted, requeued) sequences must
reproduce the same outputs.
"""

from __future__ import annotations

from cbgen.core import update
from cbgen.core.block_manager import BlockManager
from cbgen.core.scheduler import Fairness, Scheduler, SchedulerOutput
from cbgen.core.update import SampledTokens, StepUpdate
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams

EOS = 96
MAX_MODEL_LEN = 10_000


def fake_token(tokens: list[int], sample_index: int) -> int:
    """The stand-in model: the next token of a sequence."""
    return (sum(tokens) + 31 * sample_index) % 97


def expected_output(prompt: list[int], sample_index: int, max_tokens: int, eos: bool) -> list[int]:
    """What the stand-in model generates for a sample, stopping at EOS when ``eos``."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens, sample_index))
        if eos and tokens[-1] == EOS:
            break
    return tokens[len(prompt) :]


def make_group(rid: str, prompt: list[int], max_tokens: int, n: int, eos: bool) -> list[Request]:
    """The ``n`` samples of one request as the engine queues them: the leader first, the followers
    waiting for its prompt."""
    params = SamplingParams(max_tokens=max_tokens, n=n)
    samples = [
        Request(
            request_id=f"{rid}#{i}",
            prompt_token_ids=prompt,
            params=params,
            eos_token_ids=frozenset({EOS}) if eos else frozenset(),
            group_id=rid,
            sample_index=i,
        )
        for i in range(n)
    ]
    leader = samples[0]
    leader.followers = samples[1:]
    for follower in leader.followers:
        follower.leader = leader
        follower.status = RequestStatus.WAITING_FOR_FORK
    return samples


def cost(r: Request) -> int:
    """A sequence's share of the liveness bound: it computes at most ``p + m`` tokens as the oldest
    running sequence, plus one step in which it may end without computing (docs/design.md)."""
    return r.num_prompt_tokens + r.max_tokens + 1


class Driver:
    """Adds requests as the engine does and runs steps: schedule -> advance -> sample -> apply.

    Liveness (docs/design.md, "Scheduling and the liveness bound"): with first come, first served
    scheduling, every sequence ends within ``sum of (p + m + 1) + 2`` steps, the sum over the
    sequences live at some point in between, counted from the step that first scheduled it.  The
    driver asserts it for each sequence as it ends (``bounded=False`` turns that off)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        caching: bool = True,
        bounded: bool = True,
    ):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, budget, max_seqs)
        self.bounded = bounded
        self.ends: dict[str, int] = {}
        self.all: list[Request] = []
        self.steps = 0  # steps run so far
        self.added_at: dict[str, int] = {}  # request id -> steps run before it was added
        self.first_at: dict[str, int] = {}  # request id -> the step that first scheduled it
        self.ended_at: dict[str, int] = {}  # request id -> the step (or the steps run) when it ended
        self.longest_wait = 0  # the most steps a sequence took from its first scheduling to its end

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, n: int = 1, eos: bool = False
    ) -> list[Request]:
        samples = make_group(rid, prompt, max_tokens, n, eos)
        self.all += samples
        for s in samples:
            self.added_at[s.request_id] = self.steps
        self.sched.add(samples[0])
        return samples

    def bound(self, first: int, last: int) -> int:
        """The liveness bound over steps ``first..last``: the sequences that took part in one of them."""
        live = [
            r
            for r in self.all
            if self.added_at[r.request_id] < last and self.ended_at.get(r.request_id, last) >= first
        ]
        return sum(cost(r) for r in live) + 2

    def record(self, ended: list[Request]) -> None:
        for r in ended:
            rid = r.request_id
            self.ends[rid] = self.ends.get(rid, 0) + 1
            self.ended_at[rid] = self.steps
            first = self.first_at.get(rid)
            if first is not None:
                took = self.steps - first + 1
                self.longest_wait = max(self.longest_wait, took)
                if self.bounded:
                    bound = self.bound(first, self.steps)
                    assert took <= bound, f"{rid} took {took} steps from its first scheduling, bound {bound}"

    def abort(self, r: Request) -> None:
        self.record(update.finish(self.sched, r, RequestStatus.FINISHED_ABORTED))

    def step(self, fail: set[int] = frozenset()) -> tuple[SchedulerOutput, StepUpdate]:
        self.steps += 1
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
        for r in out.failed:
            self.record(update.finish(self.sched, r, RequestStatus.FINISHED_ERROR, r.error))
        requests = []
        for r, n in out.scheduled:
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_ids) * self.bm.block_size >= r.num_computed_tokens + n
            requests += update.sampling_sequences(r, n)
        for r in [r for r, _ in out.scheduled] + requests:  # forked followers are scheduled by their leader
            self.first_at.setdefault(r.request_id, self.steps)
        crossed = update.advance(out.scheduled, self.bm.block_size)
        tokens = [fake_token(r.token_ids, r.sample_index) for r in requests]
        zeros = [0.0] * len(requests)
        sampled = SampledTokens(
            tokens, zeros, zeros, zeros, failed={i: "boom" for i in fail if i < len(requests)}
        )
        result = update.apply_sampled(self.sched, requests, sampled, crossed, max_model_len=MAX_MODEL_LEN)
        self.record(result.ended)
        assert all(r.is_finished for r in result.ended)
        self.sched.remove_finished()
        return out, result

    def check(self) -> None:
        live = [r for r in self.all if not r.is_finished and r.status is not RequestStatus.WAITING_FOR_FORK]
        self.bm.check_invariants([r.block_ids for r in live])
        assert self.sched.num_seats_used <= self.sched.max_num_seqs
        assert all(r.fork_seats <= len(r.followers) for r in self.sched.running)

    def drain(self, max_steps: int | None = None) -> None:
        """Steps until nothing is left, within ``max_steps``: by default the liveness bound counted
        from now, or ten times it for a driver that is not ``bounded`` (a fair scheduler: docs/design.md
        states no step bound for it, so this only catches a hang)."""
        if max_steps is None:
            bound = sum(cost(r) for r in self.all if not r.is_finished) + 2
            max_steps = bound if self.bounded else 10 * bound
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
            self.check()
        assert not self.sched.has_work(), f"the scheduler did not drain in {max_steps} steps"


def fair_driver(num_blocks: int, block_size: int, budget: int, max_seqs: int, **fairness) -> Driver:
    """A driver whose scheduler is fair; the first-come-first-served liveness bound does not apply."""
    d = Driver(num_blocks, block_size, budget, max_seqs, bounded=False)
    d.sched.fairness = Fairness(**fairness)
    return d


def first_token_step(d: Driver, r: Request, max_steps: int = 500) -> int:
    """Runs steps until ``r`` has a token or ended; returns how many it took."""
    for step in range(1, max_steps + 1):
        d.step()
        d.check()
        if r.num_output_tokens or r.is_finished:
            return step
    raise AssertionError(f"{r.request_id} got no token in {max_steps} steps")
