"""JSON parsing of large request bodies in a child process, so that it never holds this process's GIL.

``json.loads`` of a megabyte body holds the GIL for ~8 ms in one C call.  The engine thread needs the
GIL between its kernels, so a client sending such bodies back to back slowed everyone's decoding by
~1.5x on a 2-core machine although the parsing itself ran on a spare core.  The child is a bare
interpreter (``python -I``, the standard library only): it starts in tens of milliseconds and holds
a few MB.  The parent's share is sending the bytes and unpickling the result, a copy of the one
large string.  Any trouble with the child (it cannot start, it dies) falls back to parsing here.

A body whose parsed value the child cannot pickle back (JSON nested deeper than pickling recurses,
about 490 levels; ``json.loads`` itself stops near 1,000) is refused with a 400: parsing it here
instead would put the work back on this process's GIL for any client that asks, and the child,
which stays up, would gain nothing.
"""

from __future__ import annotations

import json
from typing import Any

from cbgen.server.child_worker import CHILD_LOOP, ChildWorker, UnserialisableAnswer, python_argv
from cbgen.server.errors import APIError, bad_request

# The child's whole program: bodies in, ("ok", value) or ("err", the message ``json.loads`` would
# give here) out.
_CHILD = (
    CHILD_LOOP
    + r"""
import json
def constant(name):
    raise ValueError(name + " is not valid JSON")
def handle(raw):
    try:
        return ("ok", json.loads(raw, parse_constant=constant))
    except (ValueError, RecursionError) as exc:
        return ("err", str(exc))
serve(handle)
"""
)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def unserialisable_body(exc: UnserialisableAnswer) -> APIError:
    """The 400 for a body whose parsed value a child could not pass back."""
    if exc.kind == "RecursionError":
        return bad_request(
            "request body is nested too deeply: its parsed value could not be passed back from the "
            f"process that parses large bodies ({exc}); nest it less deeply"
        )
    return bad_request(
        f"request body could not be processed: its parsed value could not be passed back from the "
        f"process that parses large bodies ({exc})"
    )


def loads_here(raw: bytes) -> Any:
    """``raw`` parsed in this process (NaN and Infinity refused); ``ValueError`` if it is not JSON."""
    return json.loads(raw, parse_constant=_constant)


class JsonChild:
    """One child process parsing JSON for this process's threads, one body at a time."""

    def __init__(self) -> None:
        self.worker = ChildWorker(lambda: python_argv(_CHILD))

    def loads(self, raw: bytes) -> Any:
        """``raw`` parsed (NaN and Infinity refused); ``ValueError`` with ``json``'s message if it is
        not JSON; :class:`APIError` (400) if its value cannot be passed back from the child.  Parsed
        here when the child is unavailable."""
        try:
            answer = self.worker.ask(raw)
        except UnserialisableAnswer as exc:
            raise unserialisable_body(exc) from None
        if answer is None:
            return loads_here(raw)
        status, value = answer
        if status == "err":
            raise ValueError(value)
        return value

    def close(self) -> None:
        """Stops the child."""
        self.worker.close()


__all__ = ["JsonChild", "loads_here", "unserialisable_body"]
