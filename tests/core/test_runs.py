"""The step contract for many cache kinds and many tokens per row, driven without a model:

* cache groups with their own block sizes and a state slot per sequence
  (:class:`cbgen.core.cache_pools.CachePools`), allocated all or nothing, freed once, forked with
  their copies;
* rows that carry drafts: the scheduler gives a decode row its drafts as extra positions, a fake
  verifier accepts the drafts that match the stand-in model and samples the token after them, and
  the update rules commit the run token by token (stops and limits inside a run) and roll back the
  rejected positions.

Property: every request ends, with exactly the tokens the stand-in model generates without drafts;
no block or slot leaks or is freed twice; counts stay consistent.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from run_driver import RunDriver, make_pools
from sched_driver import EOS, expected_output

from cbgen.core import update
from cbgen.core.scheduler import Scheduler
from cbgen.core.update import SampledTokens
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_sizes=st.sampled_from([(4,), (8,), (4, 8), (8, 2)]),
    slots=st.sampled_from([None, 3, 8]),
    num_blocks=st.integers(12, 40),
    budget=st.integers(6, 40),
    caching=st.booleans(),
)
def test_runs_with_rejections_end_with_the_tokens_of_plain_decoding(
    seed: int, block_sizes: tuple[int, ...], slots: int | None, num_blocks: int, budget: int, caching: bool
) -> None:
    rng = random.Random(seed)
    pools = make_pools(num_blocks, block_sizes, slots, caching)
    d = RunDriver(pools, budget, max_seqs=4, rng=rng)
    specs = []
    shared = [rng.randrange(97) for _ in range(9)]
    for i in range(rng.randrange(2, 7)):
        prompt = (shared if i % 2 else []) + [rng.randrange(97) for _ in range(rng.randrange(1, 14))]
        max_tokens = rng.randrange(1, 12)
        n = 2 if rng.random() < 0.3 else 1
        eos = rng.random() < 0.5
        d.add(f"r{i}", prompt, max_tokens, n, eos)
        specs.append((prompt, max_tokens, n, eos))
    for _ in range(2000):
        if not d.sched.has_work():
            break
        d.step()
        d.check()
    assert not d.sched.has_work(), "the scheduler did not drain"
    for r in d.all:
        assert r.is_finished, r.request_id
        if r.status is RequestStatus.FINISHED_ERROR:
            assert "KV blocks" in (r.error or ""), r.error  # a request larger than the whole pool
            continue
        prompt, max_tokens, _, eos = specs[int(r.group_id[1:])]
        assert r.output_token_ids == expected_output(prompt, r.sample_index, max_tokens, eos), r.request_id
    pools.check_invariants([])
    assert all(p.num_used_blocks == 0 for p in pools.pools)
    if pools.slots is not None:
        assert pools.slots.num_free == pools.slots.num_slots


def test_a_stop_inside_a_run_drops_the_rest_and_frees_the_drafted_blocks() -> None:
    pools = make_pools(16, (4,), None, True)
    sched = Scheduler(pools, 64, 4)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({EOS}))
    sched.add(r)
    out = sched.schedule()
    update.advance(out.scheduled, 4)
    update.apply_sampled(sched, [r], SampledTokens([5], [0.0], [0.0], [0.0]), [], max_model_len=100)
    r.draft_token_ids = [6, 7, EOS, 8, 9]
    out = sched.schedule()
    assert out.scheduled == [(r, 6)] and len(r.block_ids) == 3  # positions 3..8
    update.advance(out.scheduled, 4)
    # Accepted 6, 7, EOS, 8; the fifth draft rejected; then a bonus token: EOS ends the run early.
    run = [6, 7, EOS, 8, 11]
    sampled = SampledTokens(run, [0.0] * 5, [0.0] * 5, [0.0] * 5, runs=[5], rejected=[1])
    result = update.apply_sampled(sched, [r], sampled, [], max_model_len=100)
    assert r.output_token_ids == [5, 6, 7, EOS] and result.ended == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.block_ids == []
    assert pools.num_used_blocks == 0


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_limits_hold_inside_a_run(limit: str) -> None:
    pools = make_pools(16, (4,), None, False)
    sched = Scheduler(pools, 64, 4)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=3 if limit == "max_tokens" else 50))
    sched.add(r)
    out = sched.schedule()
    update.advance(out.scheduled, 4)
    update.apply_sampled(sched, [r], SampledTokens([5], [0.0], [0.0], [0.0]), [], max_model_len=100)
    r.draft_token_ids = [6, 7, 8]
    out = sched.schedule()
    update.advance(out.scheduled, 4)
    sampled = SampledTokens([6, 7, 8, 9], [0.0] * 4, [0.0] * 4, [0.0] * 4, runs=[4], rejected=[0])
    update.apply_sampled(sched, [r], sampled, [], max_model_len=100 if limit == "max_tokens" else 6)
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [5, 6, 7]


def test_the_workload_reaches_what_it_is_meant_to() -> None:
    """The property's workload is not vacuous: over a few seeds with a small pool it accepts and
    rejects drafts, forks with block and state copies, preempts, and ends every request right."""
    seen = {"accepted": 0, "rejected": 0, "copies": 0, "state copies": 0, "preemptions": 0}
    for seed in range(12):
        rng = random.Random(seed)
        pools = make_pools(10, (4, 8), 3, True)
        d = RunDriver(pools, 24, 4, rng)
        for i in range(5):
            prompt = [rng.randrange(97) for _ in range(rng.randrange(6, 14))]
            d.add(f"r{i}", prompt, rng.randrange(8, 14), 2 if i % 3 == 0 else 1, i % 4 == 0)
        for _ in range(2000):
            if not d.sched.has_work():
                break
            d.step()
            d.check()
        assert all(r.is_finished for r in d.all)
        seen["accepted"] += d.accepted_total
        seen["rejected"] += d.rejected_total
        seen["copies"] += len(d.copies)
        seen["state copies"] += len(d.state_copies)
        seen["preemptions"] += pools.stats.preemptions
    assert all(seen.values()), seen
