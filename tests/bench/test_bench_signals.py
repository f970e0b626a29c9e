"""``cbgen bench`` killed mid-run leaves nothing behind (issue #47): its busy ``--neighbour`` and the
isolated engine worker die with it, and on SIGTERM its temporary folder is removed too.

A small parent checks ``run_child``'s two ways of asking for the signal; then the real entry point runs a tiny workload with ``--neighbour nice19``; once the neighbour and the
worker are both running, the test signals the harness and waits (bounded) for every process to go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc and relies on PR_SET_PDEATHSIG", allow_module_level=True)

START_TIMEOUT = 240.0  # the harness loads the tiny model and its worker imports torch
GONE_TIMEOUT = 30.0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while listed
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever inherited it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _neighbour_and_worker(bench: subprocess.Popen) -> tuple[int, int, Path]:
    """The pids of the running neighbour and engine worker, and the worker's temporary folder."""
    found: dict[str, int] = {}

    def both() -> bool:
        assert bench.poll() is None, f"cbgen bench exited with {bench.returncode} before the test"
        for kid in _children(bench.pid):
            argv = _cmdline(kid)
            if "while True: pass" in argv:
                found["neighbour"] = kid
            elif "cbgen_bench.engines" in argv:
                found["worker"] = kid
        return len(found) == 2

    _wait_until(both, START_TIMEOUT, "the neighbour and the engine worker")
    spec = Path(_cmdline(found["worker"])[-2])  # the worker's argv: spec.json out.json
    assert spec.name == "spec.json" and spec.parent.name.startswith("cbgen-bench-"), spec
    return found["neighbour"], found["worker"], spec.parent


# A parent that starts a sleeping child the way the harness does and waits for it; the child writes
# its pid where the test can read it.
_PARENT = """
import sys
from cbgen_bench.lifetime import run_child, sigterm_unwinds
with sigterm_unwinds():
    run_child(
        [sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
         "time.sleep(600)", sys.argv[1]],
        timed=sys.argv[2] == "timed",
    )
"""


@pytest.mark.parametrize("timed", [False, True], ids=["preexec", "setpriv"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_child_dies_with_its_parent(tmp_path: Path, sig: int, timed: bool) -> None:
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", _PARENT, str(pid_file), "timed" if timed else "untimed"]
    parent = subprocess.Popen(argv)
    child = None
    try:
        _wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", GONE_TIMEOUT, "the child")
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.send_signal(sig)
        parent.wait(GONE_TIMEOUT)
        _wait_until(lambda: not _alive(child), GONE_TIMEOUT, "the child to die")
    finally:
        for pid in (parent.pid, child):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(GONE_TIMEOUT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_bench_leaves_no_process_and_on_sigterm_no_folder(tmp_path: Path, sig: int) -> None:
    cmd = [
        sys.executable, "-m", "cbgen.cli", "bench", "--tiny", "--workloads", "overhead",
        "--engines", "cbgen", "--no-check", "--repeats", "1", "--neighbour", "nice19",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bench = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    folder = None
    try:
        neighbour, worker, folder = _neighbour_and_worker(bench)
        pids = [neighbour, worker]
        assert folder.is_dir()
        bench.send_signal(sig)
        code = bench.wait(GONE_TIMEOUT)
        _wait_until(lambda: not any(map(_alive, pids)), GONE_TIMEOUT, "the neighbour and worker to die")
        if sig == signal.SIGTERM:
            assert code == 128 + signal.SIGTERM
            assert not folder.exists()
    finally:
        for pid in [bench.pid, *pids]:  # whatever outlived a failed test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        bench.wait(GONE_TIMEOUT)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # SIGKILL leaves it: nothing can run then
