"""Scheduler: budget, chunking, preemption and the exactly-once lifecycle, driven without a model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.core.block_manager import BlockManager
from cbgen.core.scheduler import Scheduler
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams


class FakeEngine:
    """The engine's update rules without a model: a sampled token is a deterministic function of the
    sequence so far, so recomputed (preempted) requests must reproduce the same outputs."""

    def __init__(self, num_blocks: int, block_size: int, budget: int, max_seqs: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, budget, max_seqs)
        self.ends: dict[str, int] = {}
        self.all: list[Request] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        r = Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens))
        self.all.append(r)
        self.sched.add(r)
        return r

    def end(self, r: Request, status: RequestStatus) -> None:
        assert not r.is_finished
        r.status = status
        self.ends[r.request_id] = self.ends.get(r.request_id, 0) + 1
        self.sched.remove(r)

    def step(self):
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
        for r in out.failed:
            self.end(r, RequestStatus.FINISHED_ERROR)
        for r, n in out.scheduled:
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_ids) * self.bm.block_size >= r.num_computed_tokens + n
            r.num_computed_tokens += n
            self.bm.cache_computed_blocks(r)
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(sum(r.token_ids) % 97)
                if r.num_output_tokens >= r.params.max_tokens:
                    self.end(r, RequestStatus.FINISHED_LENGTH)
        return out

    def check(self) -> None:
        live = [r for r in self.all if not r.is_finished]
        self.bm.check_invariants([r.block_ids for r in live])


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sum(tokens) % 97)
    return tokens[len(prompt) :]


def test_running_first_then_waiting_and_chunked_prefill():
    eng = FakeEngine(num_blocks=64, block_size=4, budget=10, max_seqs=8)
    a = eng.add("a", list(range(25)), 3)
    out = eng.step()
    assert out.scheduled == [(a, 10)]
    eng.add("b", [1, 2, 3], 3)
    out = eng.step()
    # a still has 15 prompt tokens: it takes the whole budget before b is admitted.
    assert out.scheduled == [(a, 10)]
    out = eng.step()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    out = eng.step()  # decode a and b together
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_preemption_takes_newest_and_resumes_with_same_output():
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64, max_seqs=8)
    prompts = [[i + 1] * 7 for i in range(3)]
    reqs = [eng.add(f"r{i}", p, 9) for i, p in enumerate(prompts)]
    preempted = []
    for _ in range(200):
        if not eng.sched.has_work():
            break
        out = eng.step()
        preempted += [r.request_id for r in out.preempted]
        eng.check()
    assert preempted, "the pool is too small for all three: something must be preempted"
    assert preempted[0] == "r2"  # newest first
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == expected_output(p, 9)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_request_that_can_never_fit_fails_instead_of_hanging():
    eng = FakeEngine(num_blocks=2, block_size=4, budget=64, max_seqs=8)
    r = eng.add("big", list(range(5)), 20)  # grows past 8 tokens = all blocks
    for _ in range(50):
        if not eng.sched.has_work():
            break
        eng.step()
    assert r.status is RequestStatus.FINISHED_ERROR
    assert "KV blocks" in r.error
    assert eng.bm.num_free_blocks == 2


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 6),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 10**6)), max_size=60
    ),
)
def test_invariants_under_random_add_step_abort(num_blocks, block_size, budget, max_seqs, ops):
    eng = FakeEngine(num_blocks, block_size, budget, max_seqs)
    rng = random.Random(0)
    expected: dict[str, list[int]] = {}
    for kind, x in ops:
        if kind == "add":
            rid = f"r{len(eng.all)}"
            prompt = [rng.randrange(5) for _ in range(1 + x % 12)]
            max_tokens = 1 + x % 7
            eng.add(rid, prompt, max_tokens)
            expected[rid] = expected_output(prompt, max_tokens)
        elif kind == "step":
            eng.step()
        elif kind == "abort":
            live = [r for r in eng.all if not r.is_finished]
            if live:
                eng.end(live[x % len(live)], RequestStatus.FINISHED_ABORTED)
        eng.sched.remove_finished()
        eng.check()
    for _ in range(2000):  # drain
        if not eng.sched.has_work():
            break
        eng.step()
        eng.sched.remove_finished()
        eng.check()
    assert not eng.sched.has_work()
    for r in eng.all:
        assert r.is_finished
        assert eng.ends[r.request_id] == 1, "every request ends exactly once"
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.output_token_ids == expected[r.request_id]
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
