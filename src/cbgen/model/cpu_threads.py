"""How many threads a CPU step uses: torch's thread count, less the cores other processes keep busy.

Every CPU kernel splits its work evenly over its threads and ends in a barrier.  When another process
takes one of the cores, the thread on that core runs only in the time slices the kernel scheduler
leaves it, and every barrier of every kernel waits for its next slice: one busy neighbour turned 37
tok/s of single-stream decode into 1 tok/s on a 2-core AMD EPYC Zen 4 (family 25
model 17, AVX-512; docs/design.md, "Threads that follow the load").  Nice
levels do not prevent it: with autogroup scheduling a process of another session gets its fair share
whatever its nice value.  With one thread fewer, every thread keeps a core.

:class:`ThreadGovernor` reads, every ``interval_s``, how much CPU time the machine's processes other
than this one took on the CPUs this process may run on (``/proc/stat`` against this process's own CPU
time), and :meth:`ThreadGovernor.step_threads` gives the count for the next step.  The engine sets it
around each step and restores the user's count afterwards, so a trainer sharing the process never
sees it.  Where ``/proc/stat`` cannot be read (not Linux), it does nothing.

The engine's governor reads on a thread of its own (``watch=True``), not only when a step starts.
Read at step starts only, the window after an idle spell reached back over the whole spell: a
neighbour that started a second before a new ``generate()`` was averaged over the minutes before
it, and the first steps ran on every thread beside it.  One fresh engine's prefill of the chat
workload took 7.2-7.9 s beside a ``nice 0`` busy loop against 3.7-3.9 s once the governor had seen
it (2-core AMD EPYC Zen 4).  The first window is ``FIRST_WINDOW_S`` long, so a new engine's first
steps already follow the load.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

log = logging.getLogger("cbgen")

# A neighbour counts as holding a core once it takes this share of one: at 0.4 of a core the thread
# sharing with it already loses most of its slices to barrier waits (measured in docs/design.md).
CORE_TAKEN_AT = 0.4
# Giving threads back waits for this many samples in a row that agree, so a neighbour that pauses
# for a moment does not bring the stalls back at once; taking them away happens at the first one.
RAISE_AFTER = 2
# The first window after the governor starts: /proc/stat counts in ticks (10 ms on Linux), so over
# 0.1 s a core held throughout reads 1.0 +- 0.2, far from CORE_TAKEN_AT either way.
FIRST_WINDOW_S = 0.1
# Windows read while no step consumed them; only the latest few can matter to RAISE_AFTER.
WINDOWS_KEPT = 8


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds at one moment: busy time of the watched CPUs and this process's own."""

    wall_s: float
    busy_s: float
    own_s: float


def _watched_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def read_proc_stat(cpus: list[int], path: str = "/proc/stat") -> float | None:
    """Busy seconds of ``cpus`` since boot (user, nice, system, irq, softirq and steal: time this
    process could not have had), or None where the file cannot be read."""
    wanted = {f"cpu{c}" for c in cpus}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    seen = 0
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if not fields or fields[0] not in wanted:
                    continue
                # user nice system idle iowait irq softirq steal (guest time is inside user)
                values = [int(v) for v in fields[1:9]]
                busy += values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
                seen += 1
    except (OSError, ValueError, IndexError):
        return None
    return busy / tick if seen == len(wanted) and seen else None


def _sample_now(cpus: list[int]) -> CpuSample | None:
    busy = read_proc_stat(cpus)
    if busy is None:
        return None
    return CpuSample(time.monotonic(), busy, time.process_time())


def cores_taken(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples (0 when no time passed)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def threads_for(configured: int, num_cpus: int, taken: float) -> int:
    """The thread count that leaves every thread a core: ``configured`` less the cores a neighbour
    holds beyond the ones this process does not use, and never below one."""
    lost = int(taken + (1.0 - CORE_TAKEN_AT))
    return max(1, min(configured, num_cpus - lost))


class ThreadGovernor:
    """Decides each CPU step's thread count from the load other processes put on this process's CPUs.

    ``sample`` and ``clock`` are injectable for tests: ``sample`` returns a :class:`CpuSample` or None
    (unreadable).  With ``watch`` a daemon thread reads the counters every ``interval_s`` (the first
    time after ``FIRST_WINDOW_S``) whether or not steps run, and steps only consume what it read.
    Without it, or where the thread is gone (a forked child has none), :meth:`step_threads` reads them
    itself once a window is due, so a step between reads costs one clock read.  The thread holds only
    a weak reference: it ends when the governor is collected or :meth:`close` is called.
    """

    def __init__(
        self,
        interval_s: float = 0.5,
        cpus: list[int] | None = None,
        sample: Callable[[], CpuSample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        watch: bool = False,
    ) -> None:
        self.cpus = (_watched_cpus() if cpus is None else cpus) if enabled else []
        self.interval_s = interval_s
        self._clock = clock
        # Bound to the list, not to self: a closure over self would make the governor a reference
        # cycle, and its watch thread would outlive the engine until the cycle collector ran.
        self._sample = sample or functools.partial(_sample_now, self.cpus)
        self._last = self._sample() if self.cpus else None
        self.enabled = self._last is not None
        self.taken = 0.0  # cores held by others in the last window, for stats and logs
        # Loads of windows read but not yet acted on, oldest first (appended by the watch thread,
        # taken by step_threads: a deque's append and popleft need no lock between the two).
        self._windows: deque[float] = deque(maxlen=WINDOWS_KEPT)
        self._reads = 0
        # The load the current count answers to: the latest window's when it asked for fewer threads,
        # an older one until RAISE_AFTER windows in a row ask for more.  Kept as a load, not a count,
        # so a user who changes torch's thread count is followed at once.
        self._held = 0.0
        self._agree = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if self.enabled and watch:
            self._watcher = threading.Thread(
                target=_watch,
                args=(weakref.ref(self), self._stop, FIRST_WINDOW_S),
                name="cbgen-load-watch",
                daemon=True,
            )
            weakref.finalize(self, self._stop.set)
            self._watcher.start()

    def close(self) -> None:
        """Stops the watch thread (if any); steps then read the counters themselves."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        self._watcher = None

    def read(self) -> bool:
        """Reads the counters and queues the load of the window since the last read; False (and the
        governor off) where they cannot be read."""
        now = self._sample()
        if now is None:
            self.enabled = False
            return False
        self._reads += 1
        if now.wall_s > self._last.wall_s:  # a window with no time in it says nothing
            self._windows.append(cores_taken(self._last, now))
            self._last = now
        return True

    def _due(self) -> bool:
        wait = self.interval_s if self._reads else FIRST_WINDOW_S
        return self._clock() - self._last.wall_s >= wait

    def step_threads(self, configured: int) -> int:
        """The thread count for the next step, given the user's current ``torch.get_num_threads()``."""
        if not self.enabled or configured <= 1:
            return configured
        watcher = self._watcher
        if (watcher is None or not watcher.is_alive()) and self._due() and not self.read():
            return configured
        before = threads_for(configured, len(self.cpus), self._held)
        while self._windows:
            self.taken = self._windows.popleft()
            self._update(configured)
        after = threads_for(configured, len(self.cpus), self._held)
        if after != before:
            log.info(
                "cbgen: other processes keep %.1f of %d cores busy: CPU steps run on %d of %d threads",
                self.taken,
                len(self.cpus),
                after,
                configured,
            )
        return after

    def _update(self, configured: int) -> None:
        held = threads_for(configured, len(self.cpus), self._held)
        wanted = threads_for(configured, len(self.cpus), self.taken)
        if wanted > held:
            self._agree += 1
            if self._agree < RAISE_AFTER:
                return
        self._held, self._agree = self.taken, 0

    @contextmanager
    def governed(self) -> Iterator[int]:
        """Runs the block with the governed thread count and restores the user's afterwards."""
        configured = torch.get_num_threads()
        n = self.step_threads(configured)
        if n == configured:
            yield n
            return
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(configured)


def _watch(ref: weakref.ReferenceType, stop: threading.Event, first_s: float) -> None:
    """The watch thread: reads its governor's counters every interval until stopped, collected or
    unreadable.  It holds the governor only while reading, so the engine can be collected."""
    wait = first_s
    while not stop.wait(wait):
        governor = ref()
        if governor is None or not governor.enabled or not governor.read():
            return
        wait = governor.interval_s
        del governor
