"""``cbgen serve``'s child processes (issue #47): no sequence of request bodies can switch them off.

JSON nested some 500-990 deep (in a field the server ignores) parses, but its value does not pickle
back from a child.  Each such body used to kill the child that parsed it, and after ``MAX_FAILURES``
of them the children were never started again, so every large body from then on was parsed and
templated in the server process.  Now each such body is a 400 and the same children serve the next
large body: the test finds them among the server's processes and reads, from ``/proc``, that they
read that body from their pipe.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from serverproc import ServerProcess

from cbgen.server.child_worker import MAX_FAILURES
from cbgen.server.state import LARGE_BYTES, OFFLOAD_BYTES

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
DEEP = 700  # nesting that parses but does not pickle
ARGS = ["--num-blocks", "64", "--max-prompt-tokens", "256", "--log-level", "warning"]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(model_path, tmp_path_factory.mktemp("children"), "children", ARGS)
    proc.ensure_running()
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _children(pid: int) -> dict[str, int]:
    """The server's child processes by role: ``"template"`` and ``"json"``."""
    roles: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:  # a thread that ended while listed
            continue
        for kid in map(int, kids):
            try:
                cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"cbgen.server.template_child" in cmdline:
                roles["template"] = kid
            elif b"parse_constant" in cmdline:
                roles["json"] = kid
    return roles


def _bytes_read(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


def _pad(size: int) -> str:
    return "a" * size  # an ignored field that makes the body large


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
        extra_body={"pad": _pad(LARGE_BYTES + 1024), **extra},
    )


def _completion(client: openai.OpenAI, **extra):
    return client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=1,
        temperature=0,
        extra_body={"pad": _pad(OFFLOAD_BYTES + 1024), **extra},
    )


def test_deeply_nested_bodies_are_400s_and_the_children_serve_on(server, client):
    assert len(_chat(client).choices) == 1  # templated in the template child
    assert len(_completion(client).choices) == 1  # parsed in the JSON child
    children = _children(server.pid)
    assert set(children) == {"template", "json"}, children

    for _ in range(MAX_FAILURES + 2):
        for send in (_chat, _completion):
            with pytest.raises(openai.BadRequestError) as err:
                send(client, deep=_nested(DEEP))
            assert "nested too deeply" in err.value.message

    before = {role: _bytes_read(pid) for role, pid in children.items()}
    assert len(_chat(client).choices) == 1
    assert len(_completion(client).choices) == 1
    assert _children(server.pid) == children  # the same processes, still running
    # Each read the last large body of its kind from its pipe: it, not the server, did the work.
    assert _bytes_read(children["template"]) - before["template"] > LARGE_BYTES
    assert _bytes_read(children["json"]) - before["json"] > OFFLOAD_BYTES
    assert server.proc.poll() is None
