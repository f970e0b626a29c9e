"""Scheduler proper (first come, first served): budget, chunking, preemption, forks, the never-fits
failures and the exactly-once lifecycle, driven without a model through the same
:mod:`cbgen.core.update` functions the engine runs (``sched_driver``), and the liveness bound of
docs/design.md asserted for every sequence from its first scheduling.

The fair policy, jobs and pauses are tested in ``test_fairness.py``; cache-aware admission in
``test_cache_aware.py``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_driver import EOS, Driver, expected_output

from cbgen.request import RequestStatus


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


def test_liveness_bound_is_within_a_few_steps_of_a_request_alone_and_fails_a_stall():
    """Budget 1: a request alone computes one token a step, ``p + m - 1`` steps from its first
    scheduling to its end, against a bound of ``p + m + 3``; a request that takes longer fails the
    driver's check."""
    d = Driver(num_blocks=64, block_size=4, budget=1, max_seqs=4)
    (r,) = d.add("a", list(range(1, 8)), 5)
    d.step()  # scheduled in the first step
    d.drain()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert d.longest_wait == 7 + 5 - 1
    assert d.bound(d.first_at[r.request_id], d.ended_at[r.request_id]) == 7 + 5 + 1 + 2
    stalled = Driver(num_blocks=64, block_size=4, budget=64, max_seqs=4)
    stalled.add("s", [1, 2], 2)
    stalled.step()
    stalled.steps += 100  # steps in which it made no progress
    with pytest.raises(AssertionError, match="from its first scheduling"):
        stalled.drain()


def test_a_waiting_request_that_fits_is_not_failed_by_another_outgrowing_the_pool():
    d = Driver(num_blocks=2, block_size=4, budget=64, max_seqs=8)
    (a,) = d.add("a", list(range(5)), 20)  # grows past 8 tokens = all blocks
    for _ in range(3):
        d.step()
    (b,) = d.add("b", [1, 2], 2)  # 1 block: it fits once a is gone
    d.drain(20)
    assert a.status is RequestStatus.FINISHED_ERROR
    assert b.status is RequestStatus.FINISHED_LENGTH, b.error
