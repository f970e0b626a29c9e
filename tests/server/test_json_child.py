"""The JSON child process: same answers as ``json.loads`` here, NaN refused, and parsing goes on (in a
new child, or here) when a child dies or cannot start."""

from __future__ import annotations

import json
import sys

import pytest

from cbgen.server import child_worker
from cbgen.server.json_child import JsonChild, loads_here


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


def test_a_dead_child_is_replaced_and_a_failing_one_abandoned(child, monkeypatch):
    assert child.loads(b'{"a": 1}') == {"a": 1}
    first = child.worker.process
    first.kill()
    first.wait()
    assert child.loads(b'{"a": 2}') == {"a": 2}  # answered here or by a new child, never lost
    assert child.loads(b'{"a": 3}') == {"a": 3}
    assert child.worker.process is not None and child.worker.process is not first
    # A child that cannot start: parsed here from then on.
    child.close()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert child.loads(b'{"b": [1]}') == {"b": [1]}
    assert child.worker.process is None and child.worker.failures >= child_worker.MAX_FAILURES
