"""A child process that answers one request at a time over a pipe, for work that must not hold this
process's GIL (parsing and templating megabyte request bodies).

The protocol is length-prefixed frames: bytes in, a pickle out.  A child that dies or breaks the
protocol is replaced by a fresh one on the next request; after ``MAX_FAILURES`` such failures the
worker gives up and every ``ask`` answers None, so the caller does the work in this process.
Nothing is lost either way: a failed ``ask`` returns None, it never raises.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

MAX_FAILURES = 3

# The child's side of the protocol, for programs that import it: frames in, pickles out.
CHILD_LOOP = r"""
import pickle, struct, sys
def serve(handle):
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = src.read(8)
        if len(head) < 8:
            break
        raw = src.read(struct.unpack("<Q", head)[0])
        blob = pickle.dumps(handle(raw), protocol=5)
        dst.write(struct.pack("<Q", len(blob)))
        dst.write(blob)
        dst.flush()
"""


class ChildWorker:
    """One child process (``argv()``, started on the first request) serving this process's threads,
    one request at a time.  ``greeting()``: bytes sent as the first frame of every new child (its
    setup, e.g. a pickled tokenizer), answered like any request; a child whose greeting is not
    answered with ``"ready"`` counts as failed."""

    def __init__(
        self, argv: Callable[[], Sequence[str]], greeting: Callable[[], bytes] | None = None
    ) -> None:
        self._argv = argv
        self._greeting = greeting
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.failures = 0

    def ask(self, payload: bytes) -> Any | None:
        """The child's answer to ``payload``, or None when no child can answer (the caller then does
        the work itself)."""
        with self._lock:
            proc = self._running()
            if proc is None:
                return None
            try:
                return _exchange(proc, payload)
            except Exception:  # a broken pipe, a dead child, an answer that does not unpickle
                self._failed()
                return None

    def _running(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        if self.failures >= MAX_FAILURES:  # children keep dying: this process does the work from now on
            return None
        greeting = None
        if self._greeting is not None:
            try:
                greeting = self._greeting()
            except Exception:  # e.g. the setup does not pickle: no child could ever start
                self.failures = MAX_FAILURES
                return None
        try:
            self._proc = subprocess.Popen(
                list(self._argv()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
        except OSError:  # e.g. no interpreter to start
            self.failures = MAX_FAILURES
            return None
        if greeting is not None:
            try:
                ready = _exchange(self._proc, greeting) == "ready"
            except Exception:
                ready = False
            if not ready:
                self._failed()
                return None
        return self._proc

    def _failed(self) -> None:
        self._stop()  # the next request starts a fresh child...
        self.failures += 1

    def _stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        self._proc = None

    @property
    def process(self) -> subprocess.Popen | None:
        """The running child, if any (for tests and diagnostics)."""
        return self._proc

    def close(self) -> None:
        """Stops the child (it also exits by itself when this process's end of its pipe closes)."""
        with self._lock:
            self._stop()


def _exchange(proc: subprocess.Popen, payload: bytes) -> Any:
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    stdin.write(struct.pack("<Q", len(payload)))
    stdin.write(payload)
    stdin.flush()
    size = struct.unpack("<Q", _read_exactly(stdout, 8))[0]
    return pickle.loads(_read_exactly(stdout, size))


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the child process closed its pipe")
    return data


def python_argv(program: str, isolated: bool = True) -> list[str]:
    """``python -c program`` with this interpreter (``-I``: no site or environment paths)."""
    return [sys.executable, *(["-I"] if isolated else []), "-c", program]


__all__ = ["CHILD_LOOP", "MAX_FAILURES", "ChildWorker", "python_argv"]
