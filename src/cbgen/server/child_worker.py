"""A child process that answers one request at a time over a pipe, for work that must not hold this
process's GIL (parsing and templating megabyte request bodies).

The protocol is length-prefixed frames: bytes in; out, a frame whose kind says what it holds (the
child's ready signal, a pickled answer, or why there is no answer).  A child is started when first
needed and counts as started once it has said it is ready (and answered its greeting, if any).

What a request body can do to a child never disables it:

- an answer that does not pickle (e.g. JSON nested deeper than pickling recurses) is reported by the
  child, which lives on: ``ask`` raises :class:`UnserialisableAnswer`, an error for that body alone;
- a handler that raises, or an answer this process cannot unpickle, leaves the child running and
  ``ask`` answers None (the caller does the work itself);
- a child that dies or breaks the protocol mid-request is replaced by a fresh one on the next
  request, and ``ask`` answers None.

Only failures to *start* a child count: after ``MAX_FAILURES`` starts in a row that failed, no child
is tried for ``RETRY_SECONDS`` (every ``ask`` answers None meanwhile), then one more start is tried.
A start never depends on a request body, so no sequence of bodies can switch the children off.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

MAX_FAILURES = 3
RETRY_SECONDS = 300.0

# The kinds of the child's frames (the first byte of each frame's header).
READY, ANSWER, UNSERIALISABLE, RAISED = 0, 1, 2, 3
_HEAD = struct.Struct("<BQ")

# The child's side of the protocol, for programs that import it: frames in, pickles out.  The child
# outlives any one bad answer: what cannot be pickled, or a handler's exception, is sent back as text.
CHILD_LOOP = r"""
import pickle, struct, sys
def serve(handle):
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    def send(kind, blob):
        dst.write(struct.pack("<BQ", kind, len(blob)))
        dst.write(blob)
        dst.flush()
    send(0, b"")
    while True:
        head = src.read(8)
        if len(head) < 8:
            break
        raw = src.read(struct.unpack("<Q", head)[0])
        try:
            answer = handle(raw)
        except Exception as exc:
            send(3, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
            continue
        try:
            blob = pickle.dumps(answer, protocol=5)
        except Exception as exc:
            send(2, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
            continue
        send(1, blob)
"""


class UnserialisableAnswer(Exception):
    """The child computed an answer but could not pickle it: ``kind`` is the exception's type name
    (``RecursionError`` for a value nested too deeply), ``detail`` its message."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


class _StartFailed(Exception):
    pass


class ChildWorker:
    """One child process (``argv()``, started on the first request) serving this process's threads,
    one request at a time.  ``greeting()``: bytes sent as the first frame of every new child (its
    setup, e.g. a pickled tokenizer), answered like any request; a child whose greeting is not
    answered with ``"ready"`` failed to start."""

    def __init__(
        self, argv: Callable[[], Sequence[str]], greeting: Callable[[], bytes] | None = None
    ) -> None:
        self._argv = argv
        self._greeting = greeting
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.failures = 0  # starts in a row that failed
        self.retry_seconds = RETRY_SECONDS
        self._failed_at = 0.0  # time.monotonic() of the last failed start

    def ask(self, payload: bytes) -> Any | None:
        """The child's answer to ``payload``, or None when no child can answer (the caller then does
        the work itself).  Raises :class:`UnserialisableAnswer` when the child's answer to this
        payload does not pickle (the child stays up)."""
        with self._lock:
            proc = self._running()
            if proc is None:
                return None
            try:
                kind, blob = _exchange(proc, payload)
            except Exception:  # a broken pipe, a dead child, a frame out of protocol: start afresh
                self._stop()
                return None
            if kind == UNSERIALISABLE:
                name, _, detail = blob.decode("utf-8", "replace").partition(": ")
                raise UnserialisableAnswer(name, detail)
            if kind != ANSWER:  # the handler raised: the caller does the work, as it always could
                return None
            try:
                return pickle.loads(blob)
            except Exception:  # the frame was read whole: the child is still in step
                return None

    def _running(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        if self.failures >= MAX_FAILURES and time.monotonic() - self._failed_at < self.retry_seconds:
            return None  # starts keep failing: this process does the work for a while
        try:
            self._proc = self._start()
        except _StartFailed:
            self._stop()
            self.failures += 1
            self._failed_at = time.monotonic()
            return None
        self.failures = 0
        return self._proc

    def _start(self) -> subprocess.Popen:
        greeting = None
        if self._greeting is not None:
            try:
                greeting = self._greeting()
            except Exception as exc:  # e.g. the setup does not pickle
                raise _StartFailed from exc
        try:
            proc = self._proc = subprocess.Popen(
                list(self._argv()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
        except OSError as exc:  # e.g. no interpreter to start
            raise _StartFailed from exc
        try:
            ready = _read_frame(proc)[0] == READY
            if ready and greeting is not None:
                kind, blob = _exchange(proc, greeting)
                ready = kind == ANSWER and pickle.loads(blob) == "ready"
        except Exception as exc:  # it died on the way up, or speaks another protocol
            raise _StartFailed from exc
        if not ready:
            raise _StartFailed
        return proc

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


def _exchange(proc: subprocess.Popen, payload: bytes) -> tuple[int, bytes]:
    stdin = proc.stdin
    assert stdin is not None
    stdin.write(struct.pack("<Q", len(payload)))
    stdin.write(payload)
    stdin.flush()
    return _read_frame(proc)


def _read_frame(proc: subprocess.Popen) -> tuple[int, bytes]:
    stdout = proc.stdout
    assert stdout is not None
    kind, size = _HEAD.unpack(_read_exactly(stdout, _HEAD.size))
    if kind not in (READY, ANSWER, UNSERIALISABLE, RAISED):
        raise ValueError(f"unknown frame kind {kind} from the child process")
    return kind, _read_exactly(stdout, size)


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the child process closed its pipe")
    return data


def python_argv(program: str, isolated: bool = True) -> list[str]:
    """``python -c program`` with this interpreter (``-I``: no site or environment paths)."""
    return [sys.executable, *(["-I"] if isolated else []), "-c", program]


__all__ = [
    "CHILD_LOOP",
    "MAX_FAILURES",
    "RETRY_SECONDS",
    "ChildWorker",
    "UnserialisableAnswer",
    "python_argv",
]
