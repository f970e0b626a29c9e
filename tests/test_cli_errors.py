"""Bad arguments to ``cbgen info | generate | serve | bench`` (issue #47): one line,
``cbgen COMMAND: error: ...``, exit status 2 and no traceback, through the real entry point in a
subprocess.  A missing model or a bad ``--dtype`` printed a 15-21-line traceback before, and
``cbgen bench --batch-size -3`` was accepted.  Every case runs through ``cbgen.cli.main`` in this
process; a few also run as ``python -m cbgen.cli`` in a subprocess, which costs an interpreter that
imports torch each (seconds on a busy 2-core machine, so not all of them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MISSING = "/nonexistent/cbgen-test-model"

CASES = {
    # command line -> what the error line says
    "info, missing model": (["info", MISSING], "cannot load model"),
    "info, bad dtype": (["info", "--dtype", "bogus"], "argument --dtype: unknown dtype 'bogus'"),
    "generate, missing model": (["generate", "--model", MISSING, "hi"], "cannot load model"),
    "generate, bad dtype": (["generate", "--dtype", "fp8", "hi"], "argument --dtype: unknown dtype 'fp8'"),
    "generate, negative max tokens": (["generate", "--max-tokens", "-3", "hi"], "argument --max-tokens"),
    "generate, top-p 0": (["generate", "--top-p", "0", "hi"], "argument --top-p: must be a number > 0"),
    "generate, missing file": (["generate", "--file", MISSING], "cannot read --file"),
    "serve, missing model": (["serve", "--model", MISSING], "cannot load model"),
    "serve, bad dtype": (["serve", "--dtype", "bogus"], "argument --dtype: unknown dtype"),
    "serve, port out of range": (["serve", "--port", "70000"], "argument --port"),
    "serve, no sequences": (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs"),
    "serve, client share over 1": (["serve", "--client-share", "2"], "argument --client-share"),
    "serve, not a number": (["serve", "--max-n", "many"], "argument --max-n: must be an integer >= 1"),
    "bench, negative batch size": (["bench", "--batch-size", "-3"], "argument --batch-size"),
    "bench, no repeats": (["bench", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
    "bench, unknown workload": (["bench", "--workloads", "nope"], "unknown workload(s) nope"),
}


def _cbgen(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "cbgen.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def _check(args: list[str], says: str, code: int, stderr: str, stdout: str, folder: Path) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"cbgen {args[0]}: error: ") and says in lines[0], lines[0]
    assert stdout == ""
    assert list(folder.iterdir()) == []  # nothing written (bench's report folder, say)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_is_one_line_and_status_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cbgen.cli import main

    args, says = CASES[case]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(args)
    out = capsys.readouterr()
    _check(args, says, stop.value.code, out.err, out.out, tmp_path)


@pytest.mark.parametrize("case", ["info, missing model", "generate, bad dtype", "bench, negative batch size"])
def test_the_console_command_prints_the_same_line(case: str, tmp_path: Path) -> None:
    args, says = CASES[case]
    run = _cbgen(args, tmp_path)
    _check(args, says, run.returncode, run.stderr, run.stdout, tmp_path)


def test_bench_with_a_missing_model_ends_on_one_error_line(tmp_path: Path) -> None:
    """The harness logs the load it starts; the failure is then one line, not a traceback."""
    run = _cbgen(["bench", "--model", MISSING, "--workloads", "overhead", "--out", str(tmp_path)], tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("cbgen bench: error: cannot load model")
