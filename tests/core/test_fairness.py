"""The jobs, pause and fairness policy (:mod:`cbgen.core.fairness`): the ledger of jobs, service
and pauses on its own, and the fair order of a step driven through the scheduler without a model
(``sched_driver``).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_driver import Driver, expected_output, fair_driver, first_token_step

from cbgen.core.fairness import Fairness, Jobs
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams


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
        # No liveness bound while paused: the group waits for as long as its reader does.
        d = Driver(num_blocks=64, block_size=4, budget=32, max_seqs=8, bounded=False)
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
            assert 0 <= d.sched.jobs.old_credit <= budget
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


# ---------------------------------------------------------------------------------------------- the ledger
def group_request(group_id: str) -> Request:
    return Request(
        request_id=f"{group_id}#0",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=1),
        group_id=group_id,
    )


@settings(max_examples=200, deadline=None)
@given(
    fair=st.booleans(),
    quantum=st.integers(0, 20),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set_job", "release", "pause", "resume", "charge", "cached"]),
            st.integers(0, 5),  # a group
            st.integers(0, 3),  # a job
            st.integers(0, 9),  # tokens
        ),
        max_size=80,
    ),
)
def test_job_ledger_under_random_ops(fair, quantum, ops):
    """Jobs on their own, against a plain model: service is what was charged to the job since its
    last group was released, never negative; release forgets the group's job and pause, and the job's
    service with its last group; a job is young only when fair and under its quantum."""
    jobs = Jobs(Fairness(quantum=quantum) if fair else None)
    requests = {f"g{i}": group_request(f"g{i}") for i in range(6)}
    job_of: dict[str, str] = {}
    served: dict[str, int] = {}
    paused: set[str] = set()

    def job(g: str) -> str:
        return job_of.get(g, g)

    def release(g: str) -> None:
        paused.discard(g)
        if g in job_of:
            j = job_of.pop(g)
            if j not in job_of.values():
                served.pop(j, None)

    for kind, gi, ji, n in ops:
        g = f"g{gi}"
        if kind == "set_job":
            jobs.set_job(g, f"job{ji}")
            release(g)
            job_of[g] = f"job{ji}"
        elif kind == "release":
            jobs.release(g)
            release(g)
        elif kind == "pause":
            jobs.pause(g)
            paused.add(g)
        elif kind == "resume":
            jobs.resume(g)
            paused.discard(g)
        elif kind == "charge":
            jobs.charge([(requests[g], n)], list(requests.values()), [])
            served[job(g)] = served.get(job(g), 0) + n
        else:  # prompt tokens found in the prefix cache count only when fair
            jobs.charge_cached(requests[g], n)
            if fair:
                served[job(g)] = served.get(job(g), 0) + n
        assert jobs.paused == paused
        for g, r in requests.items():
            assert jobs.job(r) == job(g)
            assert jobs.served(r) == served.get(job(g), 0) >= 0
            assert jobs.is_young(r) == (fair and served.get(job(g), 0) < quantum)
            assert jobs.is_old(r) == (not jobs.is_young(r))


def test_charge_forgets_the_service_of_jobs_that_are_gone_and_only_those():
    """Groups nobody released leave service behind; once the table grows past the live work, the
    entries of jobs with no live request and no set_job group go, and the others stay."""
    jobs = Jobs(Fairness(quantum=10))
    live = [group_request(f"live{i}") for i in range(3)]
    jobs.set_job("batch0", "batch")  # its group ended but was not released: the job is kept
    kept = group_request("batch0")
    gone = [group_request(f"gone{i}") for i in range(100)]
    jobs.charge([(r, 5) for r in [*live, kept, *gone]], live[:2], live[2:])
    assert all(jobs.served(r) == 5 for r in [*live, kept])
    assert all(jobs.served(r) == 0 for r in gone)


# ---------------------------------------------------------------------------------------------- the order
@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(1, 12),
    groups=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 3)), min_size=2, max_size=6),
    max_tokens=st.integers(2, 30),
    joined=st.booleans(),
)
def test_old_jobs_are_served_least_attained_service_first(budget, groups, max_tokens, joined):
    """Every job old (quantum 0), seats and blocks to spare: in each step the running sequences that
    get the budget are those of the least-served jobs, whatever their arrival order."""
    d = fair_driver(num_blocks=1000, block_size=4, budget=budget, max_seqs=64, quantum=0)
    for i, (prompt_len, n) in enumerate(groups):
        d.add(f"g{i}", [1 + i] * prompt_len, max_tokens, n=n)
        if joined and i % 2:  # odd groups share one job
            d.sched.set_job(f"g{i}", "odd")
    while d.sched.has_work():
        before = {r.request_id: d.sched.served(r) for r in d.sched.running}
        running = list(d.sched.running)
        out, _ = d.step()
        got = {r.request_id for r, _ in out.scheduled}
        served = [before[r.request_id] for r in running if r.request_id in got]
        skipped = [before[r.request_id] for r in running if r.request_id not in got]
        assert not out.preempted
        if served and skipped:
            assert max(served) <= min(skipped)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in d.all)


@settings(max_examples=60, deadline=None)
@given(
    share=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    budget=st.integers(4, 32),
    hog_n=st.integers(2, 8),
    smalls=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=5
    ),
)
def test_old_work_stays_within_its_share_while_young_jobs_compute(share, budget, hog_n, smalls):
    """An old job decoding many rows and young jobs arriving now and then: over every run of steps
    with young work, old work gets at most ``old_share`` tokens per young token, and the credit that
    carries it between steps stays within ``[0, budget]``."""
    d = fair_driver(num_blocks=400, block_size=4, budget=budget, max_seqs=16, quantum=6, old_share=share)
    run = [0, 0]  # young, old tokens since the last step without young work

    def step() -> None:
        young = {r.request_id for r in d.all if d.sched.is_young(r)}
        out, _ = d.step()
        young_tokens = sum(n for r, n in out.scheduled if r.request_id in young)
        run[:] = [run[0] + young_tokens, run[1] + out.num_tokens - young_tokens] if young_tokens else [0, 0]
        assert run[1] <= share * run[0]
        assert 0 <= d.sched.jobs.old_credit <= budget

    d.add("hog", [1, 2, 3], 60, n=hog_n)
    for i, (gap, prompt_len, max_tokens) in enumerate(smalls):
        for _ in range(gap):
            step()
        d.add(f"small{i}", [4 + i] * prompt_len, max_tokens)
        for _ in range(8):
            step()
    d.drain()
