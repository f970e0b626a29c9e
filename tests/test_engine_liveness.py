"""The per-sequence liveness watch (tests/engine_liveness.py) fails when the bound is broken and sees
every sequence of a real engine (so the fuzz test's liveness check can fail)."""

from __future__ import annotations

import dataclasses

import pytest

from cbgen import LLM, SamplingParams
from cbgen.core.scheduler import SchedulerOutput
from engine_liveness import LivenessWatch, SeqRecord, check_end, window_bound
from tiny_models import make_model

G = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_the_window_counts_the_sequences_live_in_it():
    records = {
        "a": SeqRecord(cost=5, added_at=0, first_at=1, ended_at=4),
        "b": SeqRecord(cost=7, added_at=2, first_at=3, ended_at=None),
        "c": SeqRecord(cost=100, added_at=0, first_at=1, ended_at=2),  # ended before the window
        "d": SeqRecord(cost=100, added_at=9, first_at=None, ended_at=None),  # added after it
    }
    assert window_bound(records, 3, 9) == 5 + 7 + 2


def test_a_sequence_over_the_bound_fails_and_a_weight_change_restarts_its_window():
    records = {"a": SeqRecord(cost=5, added_at=0, first_at=1, ended_at=8)}
    with pytest.raises(AssertionError, match="took 8 steps"):
        check_end(records, "a", restart_at=0)
    check_end(records, "a", restart_at=2)  # counted from step 3: 6 steps, bound 7
    records["a"].ended_at = 7
    check_end(records, "a", restart_at=0)  # 7 steps, bound 7


@pytest.fixture(scope="module")
def model():
    return make_model("llama", vocab_size=128, max_position_embeddings=256)


def _run(engine, watch: LivenessWatch, prompts: list[list[int]], params: SamplingParams) -> None:
    for p in prompts:
        watch.added(engine.add_request(p, params), params)
    while engine.has_unfinished():
        watch.step()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_watch_sees_every_sequence_of_a_real_engine(model, async_scheduling):
    llm = LLM(model, block_size=4, max_num_seqs=2, async_scheduling=async_scheduling)
    watch = LivenessWatch(llm.engine)
    _run(llm.engine, watch, [[5, 6, 7], [8, 9, 10, 11]], dataclasses.replace(G, n=2))
    assert len(watch.records) == 4
    assert all(r.first_at is not None and r.ended_at is not None for r in watch.records.values())


def test_a_stalled_engine_breaks_the_bound(model):
    """A scheduler that schedules nothing for a while after a sequence started (a hang that later
    recovers, which an end-of-run check would miss) trips the per-sequence check."""
    llm = LLM(model, block_size=4, async_scheduling=False)
    schedule, calls = llm.engine.scheduler.schedule, [0]

    def stalling():
        calls[0] += 1
        return SchedulerOutput() if 2 <= calls[0] < 40 else schedule()

    llm.engine.scheduler.schedule = stalling
    watch = LivenessWatch(llm.engine)
    with pytest.raises(AssertionError, match="bound"):
        _run(llm.engine, watch, [[5, 6, 7]], G)
