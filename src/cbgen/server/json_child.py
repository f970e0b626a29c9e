"""JSON parsing of large request bodies in a child process, so that it never holds this process's GIL.

``json.loads`` of a megabyte body holds the GIL for ~8 ms in one C call.  The engine thread needs the
GIL between its kernels, so a client sending such bodies back to back slowed everyone's decoding by
~1.5x on a 2-core machine although the parsing itself ran on a spare core.  The child is a bare
interpreter (``python -I``, the standard library only): it starts in tens of milliseconds and holds
a few MB.  The parent's share is sending the bytes and unpickling the result, a copy of the one
large string.  Any trouble with the child (it cannot start, it dies) falls back to parsing here.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import struct
import subprocess
import sys
import threading
from typing import IO, Any

# The child's whole program: length-prefixed bodies in, length-prefixed pickles out.  An error is
# answered as ("err", message), with the message ``json.loads`` would give here.
_CHILD = r"""
import json, pickle, struct, sys
def constant(name):
    raise ValueError(name + " is not valid JSON")
src, dst = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = src.read(8)
    if len(head) < 8:
        break
    raw = src.read(struct.unpack("<Q", head)[0])
    try:
        out = ("ok", json.loads(raw, parse_constant=constant))
    except (ValueError, RecursionError) as exc:
        out = ("err", str(exc))
    blob = pickle.dumps(out, protocol=5)
    dst.write(struct.pack("<Q", len(blob)))
    dst.write(blob)
    dst.flush()
"""


_MAX_FAILURES = 3


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_here(raw: bytes) -> Any:
    """``raw`` parsed in this process (NaN and Infinity refused); ``ValueError`` if it is not JSON."""
    return json.loads(raw, parse_constant=_constant)


class JsonChild:
    """One child process parsing JSON for this process's threads, one body at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._failures = 0

    def loads(self, raw: bytes) -> Any:
        """``raw`` parsed (NaN and Infinity refused); ``ValueError`` with ``json``'s message if it is
        not JSON.  Parsed here when the child is unavailable."""
        with self._lock:
            answer = self._ask(raw)
        if answer is None:
            return loads_here(raw)
        status, value = answer
        if status == "err":
            raise ValueError(value)
        return value

    def _ask(self, raw: bytes) -> tuple[str, Any] | None:
        proc = self._running()
        if proc is None:
            return None
        try:
            stdin, stdout = proc.stdin, proc.stdout
            assert stdin is not None and stdout is not None
            stdin.write(struct.pack("<Q", len(raw)))
            stdin.write(raw)
            stdin.flush()
            size = struct.unpack("<Q", _read_exactly(stdout, 8))[0]
            return pickle.loads(_read_exactly(stdout, size))
        except (OSError, EOFError, struct.error, pickle.UnpicklingError):
            self._stop()  # the next body starts a fresh child...
            self._failures += 1
            return None

    def _running(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._failures >= _MAX_FAILURES:  # ...unless children keep dying: parse here from now on
            return None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        except OSError:  # e.g. no interpreter to start
            self._failures = _MAX_FAILURES
            return None
        return self._proc

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

    def close(self) -> None:
        """Stops the child (it also exits by itself when this process's end of its pipe closes)."""
        with self._lock:
            self._stop()


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the JSON child process closed its pipe")
    return data


__all__ = ["JsonChild", "loads_here"]
