"""The CPU thread governor (``cbgen.model.cpu_threads``): how many threads a step gets while other
processes hold cores, when it changes its mind, that it gives the user's count back, and that the
engine's output does not depend on it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbgen import LLM, SamplingParams
from cbgen.model import cpu_threads
from cbgen.model.cpu_threads import (
    CORE_TAKEN_AT,
    FIRST_WINDOW_S,
    RAISE_AFTER,
    CpuSample,
    ThreadGovernor,
    cores_taken,
    threads_for,
)
from oracle import compare, hf_greedy
from thread_helpers import AlternatingThreads
from tiny_models import make_prompts, make_wide_model


@given(
    configured=st.integers(1, 64),
    num_cpus=st.integers(1, 128),
    taken=st.floats(0.0, 130.0, allow_nan=False),
    more=st.floats(0.0, 10.0, allow_nan=False),
)
def test_threads_for_is_bounded_and_gives_way_to_load(configured, num_cpus, taken, more) -> None:
    n = threads_for(configured, num_cpus, taken)
    assert 1 <= n <= configured
    assert threads_for(configured, num_cpus, taken + more) <= n  # more load never adds threads
    if taken < CORE_TAKEN_AT and configured <= num_cpus:
        assert n == configured  # an idle machine keeps the user's count


def test_threads_for_on_two_cores() -> None:
    assert threads_for(2, 2, 0.0) == 2
    assert threads_for(2, 2, CORE_TAKEN_AT - 0.01) == 2
    assert threads_for(2, 2, CORE_TAKEN_AT) == 1  # a neighbour holding 0.4 of a core already costs one
    assert threads_for(2, 2, 1.0) == 1
    assert threads_for(2, 2, 2.0) == 1  # never zero
    # Cores this process does not use absorb the load first.
    assert threads_for(16, 32, 10.0) == 16
    assert threads_for(16, 32, 20.0) == 12


def test_cores_taken_subtracts_this_process() -> None:
    before = CpuSample(wall_s=10.0, busy_s=100.0, own_s=50.0)
    after = CpuSample(wall_s=11.0, busy_s=102.0, own_s=51.0)  # 2 cores busy, 1 of them ours
    assert cores_taken(before, after) == pytest.approx(1.0)
    assert cores_taken(before, CpuSample(10.0, 100.0, 50.0)) == 0.0  # no time passed
    assert cores_taken(before, CpuSample(11.0, 101.0, 51.5)) == 0.0  # clock skew: never negative


class FakeMachine:
    """A clock and a CPU counter: ``others`` cores busy besides this process's ``own`` cores.  Safe to
    read from a governor's watch thread while the test advances it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.others = 0.0
        self.own_rate = 2.0
        self.reads = 0
        self.readers: set[str] = set()
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
            self.busy += (self.others + self.own_rate) * seconds
            self.own += self.own_rate * seconds

    def sample(self) -> CpuSample:
        with self._lock:
            self.reads += 1
            self.readers.add(threading.current_thread().name)
            return CpuSample(self.now, self.busy, self.own)

    def wait_reads(self, n: int, timeout_s: float = 10.0) -> None:
        """Waits (real time) until the counters were read ``n`` times in all."""
        deadline = time.monotonic() + timeout_s
        while self.reads < n:
            assert time.monotonic() < deadline, f"only {self.reads} reads of {n}"
            time.sleep(0.001)


def _governor(machine: FakeMachine) -> ThreadGovernor:
    return ThreadGovernor(interval_s=0.5, cpus=[0, 1], sample=machine.sample, clock=lambda: machine.now)


def test_governor_drops_at_once_and_raises_after_agreeing_windows() -> None:
    m = FakeMachine()
    gov = _governor(m)
    assert gov.enabled and gov.step_threads(2) == 2
    m.advance(FIRST_WINDOW_S)
    assert gov.step_threads(2) == 2  # the first window, short: idle
    m.others = 1.0
    m.advance(0.1)
    assert gov.step_threads(2) == 2  # within the interval: nothing read, nothing changed
    m.advance(0.5)
    assert gov.step_threads(2) == 1  # the first window with a neighbour drops a thread
    assert gov.taken == pytest.approx(1.0 * 0.6 / 0.6)
    m.others, m.own_rate = 0.0, 1.0  # the neighbour leaves
    for _ in range(RAISE_AFTER - 1):
        m.advance(0.5)
        assert gov.step_threads(2) == 1
    m.advance(0.5)
    assert gov.step_threads(2) == 2
    assert gov.step_threads(1) == 1  # the user's own lower count is obeyed at once


def test_governor_follows_the_users_count_under_the_held_load() -> None:
    """The governor holds to a load, not a count: a user who raises torch's threads between steps
    gets them at once, less the cores the neighbour holds."""
    m = FakeMachine()
    gov = ThreadGovernor(interval_s=0.5, cpus=[0, 1, 2, 3], sample=m.sample, clock=lambda: m.now)
    m.others = 2.0
    m.advance(0.6)
    assert gov.step_threads(2) == 2  # two free cores: nothing to give up
    assert gov.step_threads(4) == 2  # four asked for, two cores held by the neighbour
    assert gov.step_threads(3) == 2


def test_a_new_governor_reads_its_first_window_early() -> None:
    """A fresh engine's first steps already follow a neighbour that was there when it started."""
    m = FakeMachine()
    m.others = 1.0
    gov = _governor(m)
    m.advance(FIRST_WINDOW_S / 2)
    assert gov.step_threads(2) == 2  # too short to tell
    m.advance(FIRST_WINDOW_S / 2)
    assert gov.step_threads(2) == 1


def test_governor_reads_the_counters_once_per_interval() -> None:
    m = FakeMachine()
    gov = _governor(m)
    m.advance(FIRST_WINDOW_S)
    gov.step_threads(2)
    reads = m.reads
    for _ in range(100):
        m.advance(0.001)
        gov.step_threads(2)
    assert m.reads - reads == 0
    m.advance(0.5)
    gov.step_threads(2)
    assert m.reads - reads == 1


def test_governor_off_where_counters_cannot_be_read() -> None:
    gov = ThreadGovernor(cpus=[0, 1], sample=lambda: None)
    assert not gov.enabled and gov.step_threads(2) == 2
    assert not ThreadGovernor(enabled=False).enabled
    m = FakeMachine()
    gov = _governor(m)
    m.advance(1.0)
    gov._sample = lambda: None  # the file went away mid-run: stop governing, keep the user's count
    assert gov.step_threads(2) == 2 and not gov.enabled


def _watching(machine: FakeMachine, interval_s: float = 0.005) -> ThreadGovernor:
    return ThreadGovernor(
        interval_s=interval_s, cpus=[0, 1], sample=machine.sample, clock=lambda: machine.now, watch=True
    )


def test_watch_thread_sees_a_neighbour_that_came_while_no_step_ran() -> None:
    """The watch thread reads the counters while the engine idles, so the first step after an idle
    spell answers to the last window, not to an average over the whole spell; steps do not read
    themselves while it runs."""
    m = FakeMachine()
    gov = _watching(m)
    m.readers.clear()  # the constructor's own first read
    try:
        m.wait_reads(3)  # no time passed: windows with nothing in them are not counted
        assert not gov._windows
        m.advance(30.0)  # a long idle spell, read as one window...
        m.wait_reads(m.reads + 2)
        m.others = 1.0  # ...then a neighbour for the last half second
        m.advance(0.5)
        m.wait_reads(m.reads + 2)
        assert gov.step_threads(2) == 1
        assert gov.taken == pytest.approx(1.0)
        assert m.readers == {"cbgen-load-watch"}
        # Only the latest windows are kept for a step to act on.
        for _ in range(2 * cpu_threads.WINDOWS_KEPT):
            m.advance(0.5)
            m.wait_reads(m.reads + 1)
        assert len(gov._windows) == cpu_threads.WINDOWS_KEPT
    finally:
        gov.close()


def test_watch_thread_ends_with_its_governor() -> None:
    m = FakeMachine()
    gov = _watching(m)
    watcher = gov._watcher
    assert watcher is not None and watcher.is_alive() and watcher.daemon
    del gov
    gc.collect()
    watcher.join(timeout=10.0)
    assert not watcher.is_alive()
    # close(): the steps read the counters themselves again.
    gov = _watching(m, interval_s=0.5)
    gov.close()
    assert gov._watcher is None
    m.readers.clear()
    m.advance(1.0)
    gov.step_threads(2)
    assert m.readers == {threading.current_thread().name}
    # Counters that become unreadable stop the thread and the governing.
    gov = _watching(m)
    watcher = gov._watcher
    gov._sample = lambda: None
    watcher.join(timeout=10.0)
    assert not watcher.is_alive() and not gov.enabled and gov.step_threads(2) == 2


def test_governed_restores_the_users_count(monkeypatch) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = FakeMachine()
        gov = _governor(m)
        m.others = 1.0
        m.advance(1.0)
        with gov.governed() as n:
            assert n == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), gov.governed():
            raise RuntimeError("a step that raises")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_read_proc_stat(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 0 10 100 0 0 0 0 0 0\n"
        "cpu0 100 5 20 1000 7 1 2 3 0 0\n"
        "cpu1 200 0 30 900 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    tick = cpu_threads.os.sysconf("SC_CLK_TCK")
    # user + nice + system + irq + softirq + steal; idle and iowait are not busy.
    assert cpu_threads.read_proc_stat([0], str(stat)) == pytest.approx((100 + 5 + 20 + 1 + 2 + 3) / tick)
    assert cpu_threads.read_proc_stat([0, 1], str(stat)) == pytest.approx((131 + 230) / tick)
    assert cpu_threads.read_proc_stat([0, 2], str(stat)) is None  # a CPU with no line
    assert cpu_threads.read_proc_stat([0], str(tmp_path / "missing")) is None


def test_engine_output_does_not_depend_on_the_thread_count() -> None:
    """Greedy output stays transformers' while the count changes every step, each step reports the
    count it ran on, and the user's count is back after every step."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = make_wide_model("llama", dtype=torch.float32)
        prompts = make_prompts(6, (5, 40), vocab=model.config.vocab_size, seed=5)
        llm = LLM(model, block_size=8, max_num_batched_tokens=48)
        engine = llm.engine
        engine.threads = AlternatingThreads()
        ids = [engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0)) for p in prompts]
        got: dict[str, list[int]] = {}
        threads = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            threads.append(engine.last_step.threads)
            assert torch.get_num_threads() == 2
        assert threads == engine.threads.seen and set(threads) == {1, 2}
        refs = [hf_greedy(model, p, 10) for p in prompts]
        compare(model, prompts, [got[i] for i in ids], refs)
    finally:
        torch.set_num_threads(before)
