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
from sched_driver import EOS, MAX_MODEL_LEN, expected_output, fake_token

from cbgen.core import update
from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_pools import BlockCopy, CachePools
from cbgen.core.scheduler import Scheduler
from cbgen.core.slots import SlotPool
from cbgen.core.update import SampledTokens
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams


def _pools(num_blocks: int, block_sizes: tuple[int, ...], slots: int | None, caching: bool) -> CachePools:
    pools = [BlockManager(num_blocks, bs, caching, group=g) for g, bs in enumerate(block_sizes)]
    for p in pools[1:]:
        p.stats = pools[0].stats
    return CachePools(pools, SlotPool(slots) if slots else None)


class RunDriver:
    """Schedule -> propose drafts -> advance -> verify (fake) -> apply, as the engine would."""

    def __init__(self, pools: CachePools, budget: int, max_seqs: int, rng: random.Random) -> None:
        self.pools = pools
        self.sched = Scheduler(pools, budget, max_seqs)
        self.rng = rng
        self.all: list[Request] = []
        self.rejected_total = 0
        self.accepted_total = 0
        self.copies: list[BlockCopy] = []
        self.state_copies: list[tuple[int, int]] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int, eos: bool) -> None:
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
        for f in leader.followers:
            f.leader = leader
            f.status = RequestStatus.WAITING_FOR_FORK
        self.all += samples
        self.sched.add(leader)

    def _propose(self) -> None:
        """Up to 4 drafts for decoding rows, each right (the stand-in's next token) with chance 1/2."""
        for r in self.sched.running:
            if r.num_tokens - r.num_computed_tokens != 1 or self.rng.random() < 0.3:
                continue
            seq = list(r.token_ids)
            drafts = []
            for _ in range(self.rng.randrange(1, 5)):
                right = fake_token(seq, r.sample_index)
                tok = right if self.rng.random() < 0.5 else (right + 1 + self.rng.randrange(90)) % 97
                drafts.append(tok)
                seq.append(tok)
            r.draft_token_ids = drafts

    def _verify(self, r: Request) -> tuple[list[int], int]:
        """The run for ``r``'s row: its drafts as far as the stand-in agrees, then the stand-in's
        token after them; and how many drafted positions were not accepted."""
        seq = list(r.token_ids)
        run = []
        for d in r.draft_token_ids:
            if d != fake_token(seq, r.sample_index):
                break
            run.append(d)
            seq.append(d)
        run.append(fake_token(seq, r.sample_index))
        return run, len(r.draft_token_ids) - (len(run) - 1)

    def step(self) -> None:
        self._propose()
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        self.copies += out.copies
        for r in out.failed:
            update.finish(self.sched, r, RequestStatus.FINISHED_ERROR, r.error)
        requests = []
        for r, n in out.scheduled:
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens + len(r.draft_token_ids)
            for p in self.pools.pools:
                table = r.block_tables[p.group]
                assert len(table) * p.block_size >= r.num_computed_tokens + n, (p.group, r.request_id)
            if self.pools.slots is not None:
                assert r.state_slot is not None
            requests += update.sampling_sequences(r, n)
        # A request whose drafts were scheduled but that does not sample here (mid-prefill) keeps
        # them for its last chunk; one that was not scheduled this step loses them.
        scheduled = {id(r) for r, _ in out.scheduled}
        for r in self.sched.running:
            if id(r) not in scheduled:
                r.draft_token_ids = []
        crossed = update.advance(out.scheduled, self.pools.block_size)
        runs, rejected, tokens = [], [], []
        for r in requests:
            run, rej = self._verify(r)
            runs.append(len(run))
            rejected.append(rej)
            tokens += run
            self.rejected_total += rej
            self.accepted_total += len(run) - 1
        zeros = [0.0] * len(tokens)
        sampled = SampledTokens(tokens, zeros, zeros, zeros, runs=runs, rejected=rejected)
        result = update.apply_sampled(self.sched, requests, sampled, crossed, max_model_len=MAX_MODEL_LEN)
        self.copies += result.copies
        self.state_copies += result.state_copies
        assert all(r.is_finished for r in result.ended)
        self.sched.remove_finished()

    def check(self) -> None:
        live = [r for r in self.all if not r.is_finished and r.status is not RequestStatus.WAITING_FOR_FORK]
        self.pools.check_invariants(live)
        for r in live:
            assert r.num_computed_tokens <= r.num_tokens
            generated = r.num_output_tokens
            assert len(r.raw_logprobs) == len(r.token_logprobs) == len(r.kept_counts) == generated
        for c in self.copies:
            assert 0 <= c.group < len(self.pools.pools)


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
    pools = _pools(num_blocks, block_sizes, slots, caching)
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
    pools = _pools(16, (4,), None, True)
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
    pools = _pools(16, (4,), None, False)
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
        pools = _pools(10, (4, 8), 3, True)
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
