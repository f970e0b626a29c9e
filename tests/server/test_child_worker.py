"""The pipe worker under the JSON and template children: what a request can do to its child (an answer
that does not pickle, a handler that raises, a body that kills the child) never switches the child
off; only failed starts count."""

from __future__ import annotations

import pytest

from cbgen.server import child_worker
from cbgen.server.child_worker import CHILD_LOOP, ChildWorker, UnserialisableAnswer, python_argv

# A child that answers b"x" with b"x!", and misbehaves on request.
_PROGRAM = (
    CHILD_LOOP
    + r"""
import os
def handle(raw):
    if raw == b"lambda":
        return lambda: None  # does not pickle
    if raw == b"raise":
        raise KeyError("no such thing")
    if raw == b"exit":
        os._exit(3)
    return raw + b"!"
serve(handle)
"""
)


@pytest.fixture
def worker():
    w = ChildWorker(lambda: python_argv(_PROGRAM))
    yield w
    w.close()


def test_an_answer_that_does_not_pickle_raises_and_the_child_lives_on(worker):
    assert worker.ask(b"a") == b"a!"
    first = worker.process
    for _ in range(child_worker.MAX_FAILURES + 1):
        with pytest.raises(UnserialisableAnswer) as err:
            worker.ask(b"lambda")
        assert err.value.kind in ("PicklingError", "AttributeError") and "lambda" in err.value.detail
    assert worker.ask(b"b") == b"b!" and worker.process is first and worker.failures == 0


def test_a_handler_that_raises_is_answered_here_and_the_child_lives_on(worker):
    assert worker.ask(b"a") == b"a!"
    first = worker.process
    for _ in range(child_worker.MAX_FAILURES + 1):
        assert worker.ask(b"raise") is None
    assert worker.ask(b"b") == b"b!" and worker.process is first and worker.failures == 0


def test_a_body_that_kills_the_child_every_time_never_switches_it_off(worker):
    for _ in range(child_worker.MAX_FAILURES + 2):
        assert worker.ask(b"exit") is None  # the caller does the work
        assert worker.ask(b"a") == b"a!"  # a fresh child
    assert worker.failures == 0


def test_children_that_die_as_they_start_count_until_given_up_for_a_while():
    starts: list[int] = []

    def argv() -> list[str]:
        starts.append(1)
        return python_argv("raise SystemExit(1)" if len(starts) <= child_worker.MAX_FAILURES else _PROGRAM)

    w = ChildWorker(argv)
    try:
        for _ in range(child_worker.MAX_FAILURES + 2):
            assert w.ask(b"a") is None
        assert len(starts) == child_worker.MAX_FAILURES and w.failures == child_worker.MAX_FAILURES
        w.retry_seconds = 0.0
        assert w.ask(b"a") == b"a!" and w.failures == 0 and len(starts) == child_worker.MAX_FAILURES + 1
    finally:
        w.close()


def test_a_child_that_speaks_another_protocol_fails_to_start():
    w = ChildWorker(lambda: python_argv("import sys; sys.stdout.write('hello world'); sys.stdout.flush()"))
    try:
        assert w.ask(b"a") is None and w.process is None and w.failures == 1
    finally:
        w.close()
