"""Scheduler and step update rules: budget, chunking, preemption, forks and the exactly-once
lifecycle, driven without a model through the same :mod:`cbgen.core.update` functions the engine runs.

The only stand-in is the model: a sampled token is a deterministic function of the sequence so far
(and of the sample index, so n>1 samples differ), so recomputed (preempted, requeued) sequences must
reproduce the same outputs.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.core import update
from cbgen.core.block_manager import BlockManager
from cbgen.core.scheduler import Fairness, Scheduler
from cbgen.core.update import SampledTokens
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams

EOS = 96
MAX_MODEL_LEN = 10_000


def fake_token(tokens: list[int], sample_index: int) -> int:
    return (sum(tokens) + 31 * sample_index) % 97


def expected_output(prompt: list[int], sample_index: int, max_tokens: int, eos: bool) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens, sample_index))
        if eos and tokens[-1] == EOS:
            break
    return tokens[len(prompt) :]


class Driver:
    """Adds requests as the engine does and runs steps: schedule -> advance -> sample -> apply."""

    def __init__(self, num_blocks: int, block_size: int, budget: int, max_seqs: int, caching: bool = True):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, budget, max_seqs)
        self.ends: dict[str, int] = {}
        self.all: list[Request] = []

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, n: int = 1, eos: bool = False
    ) -> list[Request]:
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
        self.all += samples
        self.sched.add(leader)
        return samples

    def record(self, ended: list[Request]) -> None:
        for r in ended:
            self.ends[r.request_id] = self.ends.get(r.request_id, 0) + 1

    def abort(self, r: Request) -> None:
        self.record(update.finish(self.sched, r, RequestStatus.FINISHED_ABORTED))

    def step(self, fail: set[int] = frozenset()):
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

    def drain(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
            self.check()
        raise AssertionError("the scheduler did not drain")


def test_running_first_then_waiting_and_chunked_prefill():
    d = Driver(num_blocks=64, block_size=4, budget=10, max_seqs=8)
    (a,) = d.add("a", list(range(25)), 3)
    out, _ = d.step()
    assert out.scheduled == [(a, 10)]
    d.add("b", [1, 2, 3], 3)
    out, _ = d.step()
    # a still has 15 prompt tokens: it takes the whole budget before b is admitted.
    assert out.scheduled == [(a, 10)]
    out, _ = d.step()
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    out, _ = d.step()  # decode a and b together
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_prompts_sharing_a_prefix_wait_one_step_to_find_it_cached():
    """Prompts that share two full blocks arrive together: the first computes them, the others wait
    one step and then find them cached (a prompt without that prefix is admitted at once), so the
    shared blocks are computed once; outputs are unchanged."""
    d = Driver(num_blocks=64, block_size=4, budget=64, max_seqs=8)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    prompts = {
        "a": [*shared, 1, 2, 3],
        "b": [*shared, 4, 5],
        "c": [50, 51, 52, 53, 54, 55],
        "e": [*shared, 6],
    }
    (a,), (b,), _, (e,) = (d.add(rid, prompt, 3) for rid, prompt in prompts.items())
    out, _ = d.step()
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 11), ("c", 6)]
    out, _ = d.step()
    # b and e computed only what follows the cached 8 tokens
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 1), ("c", 1), ("b", 2), ("e", 1)]
    assert b.num_cached_tokens == e.num_cached_tokens == 8
    d.drain()
    for r in (a, b, e):
        prompt = prompts[r.group_id]
        assert r.output_token_ids == expected_output(prompt, 0, 3, eos=False)


def test_a_prompt_that_ends_at_its_first_token_leaves_its_blocks_cached():
    """max_tokens=1 (scoring, prefill-only work): the request finishes in the step that computes its
    prompt, and its full blocks are published before they are freed, for later prompts to reuse."""
    d = Driver(num_blocks=64, block_size=4, budget=64, max_seqs=8)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    (a,) = d.add("a", [*shared, 1], 1)
    d.step()
    assert a.is_finished
    (b,) = d.add("b", [*shared, 2, 3], 2)
    out, _ = d.step()
    assert out.scheduled == [(b, 2)] and b.num_cached_tokens == 8


def test_preemption_takes_newest_and_resumes_with_same_output():
    d = Driver(num_blocks=6, block_size=4, budget=64, max_seqs=8)
    prompts = [[i + 1] * 7 for i in range(3)]
    reqs = [d.add(f"r{i}", p, 9)[0] for i, p in enumerate(prompts)]
    preempted = []
    while d.sched.has_work():
        out, _ = d.step()
        preempted += [r.group_id for r in out.preempted]
        d.check()
    assert preempted, "the pool is too small for all three: something must be preempted"
    assert preempted[0] == "r2"  # newest first
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == expected_output(p, 0, 9, eos=False)
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_request_that_can_never_fit_fails_instead_of_hanging():
    d = Driver(num_blocks=2, block_size=4, budget=64, max_seqs=8)
    (r,) = d.add("big", list(range(5)), 20)  # grows past 8 tokens = all blocks
    d.drain(50)
    assert r.status is RequestStatus.FINISHED_ERROR
    assert "KV blocks" in r.error
    assert d.bm.num_free_blocks == 2


def test_n_samples_share_one_prefill_and_fork_with_a_copy_of_the_partial_block():
    d = Driver(num_blocks=32, block_size=4, budget=64, max_seqs=8)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    samples = d.add("g", prompt, 5, n=3)
    out, result = d.step()
    assert out.scheduled == [(samples[0], 10)]  # only the leader computes the prompt
    assert [r.status for r in samples] == [RequestStatus.RUNNING] * 3
    assert len(result.copies) == 2  # each follower's private copy of the partial last block
    for follower in samples[1:]:
        assert follower.block_ids[:2] == samples[0].block_ids[:2]
        assert follower.num_computed_tokens == len(prompt)
    d.drain()
    for s in samples:
        assert s.output_token_ids == expected_output(prompt, s.sample_index, 5, eos=False)
    assert d.bm.stats.prompt_tokens_computed == len(prompt)


def test_failed_row_ends_only_its_sequence_and_an_unforked_group_with_it():
    d = Driver(num_blocks=32, block_size=4, budget=64, max_seqs=8)
    (solo,) = d.add("solo", [1, 2, 3], 4)
    group = d.add("g", [4, 5, 6], 4, n=2)
    # Rows: solo, g#0, g#1 (the follower samples from its leader's last prompt row).
    _, result = d.step(fail={0})
    assert solo.status is RequestStatus.FINISHED_ERROR and solo.error == "boom"
    assert result.ended == [solo]
    d.drain()
    assert [s.status for s in group] == [RequestStatus.FINISHED_LENGTH] * 2
    # An aborted leader whose prompt was never computed takes its followers with it.
    late = d.add("late", [7, 8], 3, n=3)
    d.abort(late[0])
    assert all(s.status is RequestStatus.FINISHED_ABORTED for s in late)
    assert all(d.ends[s.request_id] == 1 for s in d.all)
    assert d.bm.num_free_blocks == d.bm.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_seqs=st.integers(3, 6),
    caching=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "step", "abort", "fail"]), st.integers(0, 10**6)),
        max_size=60,
    ),
)
def test_invariants_under_random_add_step_abort(num_blocks, block_size, budget, max_seqs, caching, ops):
    d = Driver(num_blocks, block_size, budget, max_seqs, caching)
    rng = random.Random(0)
    expected: dict[str, list[int]] = {}
    for kind, x in ops:
        if kind == "add":
            prompt = [rng.randrange(5) for _ in range(1 + x % 12)]
            max_tokens, n, eos = 1 + x % 7, 1 + (x // 7) % 3, x % 5 == 0
            for s in d.add(f"r{len(d.all)}", prompt, max_tokens, n=n, eos=eos):
                expected[s.request_id] = expected_output(prompt, s.sample_index, max_tokens, eos)
        elif kind == "step":
            d.step()
        elif kind == "fail":
            d.step(fail={x % 4})
        elif kind == "abort":
            live = [r for r in d.all if not r.is_finished]
            if live:
                d.abort(live[x % len(live)])
        d.sched.remove_finished()
        d.check()
    d.drain()
    assert not d.sched.has_work()
    for r in d.all:
        assert r.is_finished
        assert d.ends[r.request_id] == 1, "every sequence ends exactly once"
        out, want = r.output_token_ids, expected[r.request_id]
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert out == want
        elif r.status is RequestStatus.FINISHED_STOPPED:
            assert out == want and out[-1] == EOS
        else:  # aborted or failed: whatever it had was correct so far
            assert out == want[: len(out)]
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_group_larger_than_max_num_seqs_runs_in_waves_and_never_starves_the_queue():
    d = Driver(num_blocks=64, block_size=4, budget=64, max_seqs=3)
    prompt = list(range(1, 10))
    group = d.add("g", prompt, 4, n=7)
    (behind,) = d.add("b", [5, 5], 3)
    out, result = d.step()
    assert out.scheduled == [(group[0], 9)]
    # The leader reserved the two seats left: two followers fork, the other four queue on their own.
    assert len(result.copies) == 2  # the partial third prompt block, once per forked follower
    assert sum(s.status is RequestStatus.RUNNING for s in group) == 3
    assert len(d.sched.waiting) == 5 and d.sched.waiting[-1] is behind
    d.drain()
    for s in group:
        assert s.output_token_ids == expected_output(prompt, s.sample_index, 4, eos=False)
    assert behind.output_token_ids == expected_output([5, 5], 0, 3, eos=False)
    # Later waves reuse the two cached full blocks of the prompt, and copy the prompt's last token
    # from the leader's third block (full by then, with its generated tokens): a partial hit each,
    # so they compute none of the prompt, only their first sampled token.
    assert d.bm.stats.prompt_tokens_computed == 9 + len(behind.prompt_token_ids)
    assert d.bm.stats.prefix_cache_hits == 4 * 9


# ---------------------------------------------------------------------------------------------- fairness
def fair_driver(num_blocks: int, block_size: int, budget: int, max_seqs: int, **fairness) -> Driver:
    d = Driver(num_blocks, block_size, budget, max_seqs)
    d.sched.fairness = Fairness(**fairness)
    return d


def first_token_step(d: Driver, r: Request, max_steps: int = 500) -> int:
    for step in range(1, max_steps + 1):
        d.step()
        d.check()
        if r.num_output_tokens or r.is_finished:
            return step
    raise AssertionError(f"{r.request_id} got no token in {max_steps} steps")


@pytest.mark.parametrize("old_length", [40, 400])
def test_young_request_is_served_within_its_own_prefill_whatever_the_old_work(old_length):
    # The old job holds every seat (and, the longer it runs, the whole pool): first come, first served
    # would make the newcomer wait until one of its samples ends.
    d = fair_driver(num_blocks=120, block_size=4, budget=16, max_seqs=4, quantum=32)
    hog = d.add("hog", list(range(1, 13)), old_length, n=4)
    for _ in range(6):
        d.step()
    assert d.sched.num_seats_used == 4 and not d.sched.is_young(hog[0])
    (small,) = d.add("small", [7] * 20, 3)
    # 20 prompt tokens at a budget of 16: admitted in the next step, first token in the one after.
    assert first_token_step(d, small) == 2
    d.drain(20_000)
    assert small.output_token_ids == expected_output([7] * 20, 0, 3, eos=False)
    for s in hog:
        assert s.status is RequestStatus.FINISHED_LENGTH
        assert s.output_token_ids == expected_output(
            list(range(1, 13)), s.sample_index, old_length, eos=False
        )
    assert d.bm.num_free_blocks == d.bm.num_blocks


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 8]),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 8),
    hog_n=st.integers(1, 8),
    hog_prompt=st.integers(1, 40),
    old_length=st.integers(1, 300),
    warmup=st.integers(0, 30),
    small_prompt=st.integers(1, 60),
)
def test_first_token_bound_does_not_depend_on_old_work(
    block_size, budget, max_seqs, hog_n, hog_prompt, old_length, warmup, small_prompt
):
    num_blocks = -(-(hog_prompt + old_length) // block_size) + -(-(small_prompt + 1) // block_size)
    d = fair_driver(num_blocks, block_size, budget, max_seqs, quantum=small_prompt)
    hog = d.add("hog", [3] * hog_prompt, old_length, n=hog_n)
    while d.sched.is_young(hog[0]) and not all(s.is_finished for s in hog):
        d.step()
    for _ in range(warmup):
        d.step()
    (small,) = d.add("small", [1 + i % 5 for i in range(small_prompt)], 2)
    # Admitted in the next step whatever the old job holds, then only its own prefill stands between
    # it and its first token (the whole of it counts as young work: quantum = its prompt).
    bound = -(-small_prompt // budget)
    assert first_token_step(d, small) <= bound
    d.drain(50_000)
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_waiting_young_job_goes_before_running_young_jobs_with_more_service():
    # Both young (quantum 1000): the big prefill has had service, the newcomer none, so the
    # newcomer's prompt takes the budget first although the big one is running.
    d = fair_driver(num_blocks=200, block_size=4, budget=8, max_seqs=16, quantum=1000)
    (big,) = d.add("big", list(range(1, 200)), 5)
    for _ in range(3):
        d.step()
    (small,) = d.add("small", [4, 5, 6], 3)
    out, _ = d.step()
    assert out.scheduled[0] == (small, 3) and out.scheduled[1] == (big, 5)
    d.drain()
    assert big.output_token_ids == expected_output(list(range(1, 200)), 0, 5, eos=False)


@pytest.mark.parametrize("share", [0.5, 1.0, 2.0])
def test_old_work_gets_its_share_of_steps_with_young_work_in_decode_rows(share):
    d = fair_driver(num_blocks=400, block_size=4, budget=64, max_seqs=16, quantum=8, old_share=share)
    d.add("hog", [1, 2, 3], 50, n=10)
    d.add("late", list(range(30)), 50)  # its prefill is old work too
    d.sched.set_job("late", "hog")
    for _ in range(4):
        d.step()
    (small,) = d.add("small", [4, 5], 5)
    young = old = 0
    while not small.is_finished:
        out, _ = d.step()
        young += sum(n for r, n in out.scheduled if r is small)
        old += sum(n for r, n in out.scheduled if r is not small)
        assert old <= share * young
        if young > 2:  # small decodes: no old prefill chunk may join
            assert all(n == 1 and r.num_computed_tokens >= r.num_prompt_tokens for r, n in out.scheduled)
    assert old >= share * young - 1  # and old work got its share
    d.drain()


def test_prompts_of_one_job_share_its_service():
    d = fair_driver(num_blocks=200, block_size=4, budget=8, max_seqs=16, quantum=16)
    parts = [d.add(f"big{i}", [1 + i] * 12, 20)[0] for i in range(4)]
    for r in parts:
        d.sched.set_job(r.group_id, "big")
    for _ in range(3):
        d.step()
    # 24 tokens computed for the job: all four prompts are old now, though two never ran.  (Distinct
    # prompts: a prompt found in the prefix cache would count as service too.)
    assert d.sched.served(parts[3]) == 24 and not d.sched.is_young(parts[3])
    (small,) = d.add("small", [9, 9, 9], 2)
    assert first_token_step(d, small) == 1
    d.drain()
    for r in parts:
        d.sched.release(r.group_id)
    assert all(d.sched.served(r) == 0 for r in parts)  # forgotten with the job's last group


def test_paused_group_is_preempted_keeps_its_tokens_and_finishes_after_resume():
    for fairness in (None, Fairness()):
        d = Driver(num_blocks=64, block_size=4, budget=32, max_seqs=8)
        d.sched.fairness = fairness
        samples = d.add("s", [3, 1, 4, 1, 5], 30, n=2)
        (other,) = d.add("o", [2, 7], 10)
        for _ in range(5):
            d.step()
        generated = [s.num_output_tokens for s in samples]
        d.sched.pause("s")
        out, _ = d.step()
        assert set(out.preempted) == set(samples) and not any(s.block_ids for s in samples)
        while not other.is_finished:
            out, _ = d.step()
            assert all(r.group_id != "s" for r, _ in out.scheduled)
        assert [s.num_output_tokens for s in samples] == generated
        assert not d.sched.has_runnable_work() and d.sched.has_work()
        d.sched.resume("s")
        d.drain()
        for s in samples:
            assert s.output_token_ids == expected_output([3, 1, 4, 1, 5], s.sample_index, 30, eos=False)
        assert d.bm.num_free_blocks == d.bm.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_seqs=st.integers(3, 6),
    quantum=st.integers(0, 30),
    share=st.sampled_from([None, 0.5, 1.0, 3.0]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "abort", "pause", "resume", "join"]),
            st.integers(0, 10**6),
        ),
        max_size=60,
    ),
)
def test_fair_invariants_under_random_add_step_abort_pause(
    num_blocks, block_size, budget, max_seqs, quantum, share, ops
):
    d = fair_driver(num_blocks, block_size, budget, max_seqs, quantum=quantum, old_share=share)
    rng = random.Random(0)
    expected: dict[str, list[int]] = {}
    groups: list[str] = []
    run = [0, 0]  # young, old tokens since the last step without young work
    for kind, x in ops:
        if kind == "add":
            prompt = [rng.randrange(5) for _ in range(1 + x % 12)]
            max_tokens, n, eos = 1 + x % 7, 1 + (x // 7) % 3, x % 5 == 0
            groups.append(f"r{len(d.all)}")
            for s in d.add(groups[-1], prompt, max_tokens, n=n, eos=eos):
                expected[s.request_id] = expected_output(prompt, s.sample_index, max_tokens, eos)
        elif kind == "step":
            young = {r.group_id for r in d.all if d.sched.is_young(r)}
            out, _ = d.step()
            assert not any(r.group_id in d.sched.paused for r, _ in out.scheduled)
            young_tokens = sum(n for r, n in out.scheduled if r.group_id in young)
            if not young_tokens:
                run = [0, 0]
            else:  # over a run of steps with young work, old work gets at most its share
                run = [run[0] + young_tokens, run[1] + out.num_tokens - young_tokens]
                assert share is None or run[1] <= share * run[0] + 1e-9
        elif kind == "abort":
            live = [r for r in d.all if not r.is_finished]
            if live:
                d.abort(live[x % len(live)])
        elif groups and kind == "pause":
            d.sched.pause(groups[x % len(groups)])
        elif groups and kind == "resume":
            d.sched.resume(groups[x % len(groups)])
        elif groups and kind == "join":  # put a group into another's job
            d.sched.set_job(groups[x % len(groups)], groups[(x // 7) % len(groups)])
        d.sched.remove_finished()
        d.check()
        assert not any(r.group_id in d.sched.paused and r.block_ids for r in d.sched.waiting)
    for g in groups:
        d.sched.resume(g)
    d.drain()
    for r in d.all:
        assert r.is_finished and d.ends[r.request_id] == 1, "every sequence ends exactly once"
        out, want = r.output_token_ids, expected[r.request_id]
        if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            assert out == want
        else:
            assert out == want[: len(out)]
    assert d.bm.num_free_blocks == d.bm.num_blocks
