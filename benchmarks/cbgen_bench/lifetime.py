"""Child processes that die with the harness, and a SIGTERM that unwinds it.

Killed with SIGTERM, a Python process runs no ``finally`` block: the busy ``--neighbour`` (in a
session of its own) and any worker it was waiting for were re-parented to pid 1 and ran on, and
its temporary folders stayed.  Two things prevent that:

- every child the harness starts asks the kernel, between fork and exec, for a signal when its
  parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), which also covers a parent killed with SIGKILL;
  a child whose spawn is timed (the cold start) makes that request through ``setpriv --pdeathsig``
  where util-linux has it: a ``preexec_fn`` makes ``subprocess`` fork this process instead of
  vforking it, which costs time in proportion to its memory (1-4 ms -> 60-110 ms for a 1.5 GB
  parent on the 2-core Zen 4 test machine), time the cold start would count as the child's import;
- :func:`sigterm_unwinds` turns SIGTERM into ``SystemExit``, so the harness unwinds as on an error:
  ``subprocess.run`` kills the child it waits for, context managers stop the neighbour and remove
  their temporary folders.

The kernel sends the signal when the *thread* that started the child ends, so children are started
from the main thread (as everywhere in the harness).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_PR_SET_PDEATHSIG = 1


def _prctl() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    # Declared in full: a variadic int would leave the upper half of the kernel's unsigned long unset.
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess``: the child gets ``sig`` when this process (the calling
    thread) dies.  None where the platform has no such request (the child then outlives a killed
    parent, as before)."""
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was made: nobody will ask
            os.kill(os.getpid(), sig)

    return arm


def run_child(cmd: Sequence[str], timed: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` for a child that gets SIGTERM when this process dies.
    ``timed``: the spawn is part of a measurement, so it is made without a ``preexec_fn`` where
    ``setpriv`` can ask for the signal instead."""
    setpriv = shutil.which("setpriv") if timed and _PRCTL is not None else None
    if setpriv is not None:
        return subprocess.run([setpriv, "--pdeathsig", "TERM", "--", *cmd], **kwargs)
    return subprocess.run(list(cmd), preexec_fn=die_with_parent(), **kwargs)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` where the process is, so it unwinds
    and cleans up; a second SIGTERM ends it at once.  The previous handler is restored after the
    block.  Outside the main thread (where no handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["die_with_parent", "run_child", "sigterm_unwinds"]
