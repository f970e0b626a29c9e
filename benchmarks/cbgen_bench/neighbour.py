"""``--neighbour``: a process that keeps one core busy while the engines run.

The engines' users rarely have an idle machine: a trainer's data-loader workers, a tokenizer pool or a
second job share its cores.  The neighbour is a Python busy loop at the chosen nice level, started in
a session of its own.  With autogroup scheduling (the Linux default), a process of another session
gets its fair share of a core whatever its nice value, as a second job would; ``nice19`` therefore
measures the mildest neighbour a user can set up, not a free one.  It runs only while the engines
generate: the ceilings are timed on the idle machine.  It is killed when the harness dies, however
it dies (``cbgen_bench.lifetime``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from cbgen_bench.lifetime import die_with_parent

# --neighbour value -> nice level of the busy process.
NEIGHBOURS: dict[str, int] = {"nice19": 19, "nice0": 0}


@contextmanager
def busy_neighbour(mode: str | None) -> Iterator[subprocess.Popen | None]:
    """Runs the block while a busy process at ``mode``'s nice level holds one core (None: no
    neighbour); the block gets the process."""
    if mode is None:
        yield None
        return
    if mode not in NEIGHBOURS:
        raise ValueError(f"unknown neighbour {mode!r}; choose from {', '.join(NEIGHBOURS)}")
    proc = subprocess.Popen(
        ["nice", "-n", str(NEIGHBOURS[mode]), sys.executable, "-c", "while True: pass"],
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGKILL),  # a busy loop has nothing to clean up
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


__all__ = ["NEIGHBOURS", "busy_neighbour"]
