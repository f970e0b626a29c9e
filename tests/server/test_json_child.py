"""The JSON child process: same answers as ``json.loads`` here, NaN refused, parsing goes on (in a
new child, or here) when a child dies or cannot start, and no request body can switch it off."""

from __future__ import annotations

import json
import sys

import pytest

from cbgen.server import child_worker
from cbgen.server.errors import APIError
from cbgen.server.json_child import JsonChild, loads_here

# Deeper than a parsed value pickles (about 500 levels), shallower than json.loads parses (about 990).
DEEP = 700


def deep_body(depth: int = DEEP) -> bytes:
    """A valid JSON object with a field nested ``depth`` lists deep."""
    return b'{"model": "m", "ignored": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.fixture
def child():
    c = JsonChild()
    yield c
    c.close()


def test_child_parses_like_json_loads(child):
    body = {"model": "m", "messages": [{"role": "user", "content": 'café "olé" \u2603 ' * 20_000}], "n": 2}
    raw = json.dumps(body, ensure_ascii=False).encode()
    assert child.loads(raw) == body == loads_here(raw)
    assert child.loads(b"[1, 2.5, null]") == [1, 2.5, None]
    assert child.worker.process is not None and child.worker.process.poll() is None  # it ran in the child


@pytest.mark.parametrize("raw", [b"{", b'{"a": NaN}', b'{"a": -Infinity}', b"[" * 100_000])
def test_child_refuses_what_json_refuses(child, raw):
    with pytest.raises((ValueError, RecursionError)) as here:
        loads_here(raw)
    with pytest.raises(ValueError) as there:
        child.loads(raw)
    assert str(there.value) == str(here.value)


def test_a_body_whose_value_does_not_pickle_is_a_400_and_the_child_lives_on(child):
    """Issue #47: each such body used to kill the child, and three of them switched it off for good."""
    assert loads_here(deep_body())["model"] == "m"  # valid JSON, parsed here
    assert child.loads(b'{"a": 1}') == {"a": 1}
    first = child.worker.process
    for _ in range(child_worker.MAX_FAILURES + 2):
        with pytest.raises(APIError) as err:
            child.loads(deep_body())
        assert err.value.status == 400 and "nested too deeply" in err.value.message
        assert "RecursionError" in err.value.message
    assert child.worker.process is first and first.poll() is None and child.worker.failures == 0
    assert child.loads(b'{"a": 2}') == {"a": 2}
    assert child.worker.process is first  # the same child answered


def test_a_dead_child_is_replaced_however_often_it_dies(child):
    assert child.loads(b'{"a": 1}') == {"a": 1}
    for i in range(child_worker.MAX_FAILURES + 2):
        first = child.worker.process
        first.kill()
        first.wait()
        assert child.loads(b'{"a": 2}') == {"a": 2}  # answered here or by a new child, never lost
        assert child.loads(b'{"a": 3}') == {"a": 3}
        assert child.worker.process is not None and child.worker.process is not first, i
        assert child.worker.failures == 0


def test_a_child_that_cannot_start_is_retried_after_a_while(child, monkeypatch):
    """Only failed starts count; after ``MAX_FAILURES`` in a row none is tried until
    ``retry_seconds`` have passed, and then one is."""
    starts = []
    real = child.worker._argv
    child.worker._argv = lambda: starts.append(1) or real()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    for _ in range(child_worker.MAX_FAILURES + 2):
        assert child.loads(b'{"b": [1]}') == {"b": [1]}  # parsed here
    assert len(starts) == child_worker.MAX_FAILURES and child.worker.process is None
    assert child.worker.failures == child_worker.MAX_FAILURES
    monkeypatch.undo()
    assert child.loads(b'{"b": [2]}') == {"b": [2]}
    assert len(starts) == child_worker.MAX_FAILURES and child.worker.process is None  # still waiting
    child.worker.retry_seconds = 0.0
    assert child.loads(b'{"b": [3]}') == {"b": [3]}
    assert len(starts) == child_worker.MAX_FAILURES + 1 and child.worker.process is not None
    assert child.worker.failures == 0
