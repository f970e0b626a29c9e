"""``cbgen bench`` is a thin entry point into the separate ``cbgen_bench`` package: it reaches the harness
when it is installed, says how to install it when it is not, and nothing else in cbgen imports it."""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

import pytest

from cbgen.cli import main

SRC = Path(__file__).resolve().parents[2] / "src" / "cbgen"


class _NotInstalled(importlib.abc.MetaPathFinder):
    """Fails ``import cbgen_bench`` the way a Python without the package does."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname.partition(".")[0] == "cbgen_bench":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def test_bench_reaches_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cbgen bench")
    assert "--null-model" in out


def test_bench_without_the_harness_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "cbgen_bench" or m.startswith("cbgen_bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled(), *sys.meta_path])
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    message = str(exc.value.code)
    assert "pip install -e benchmarks" in message
    assert "make bench" in message


def test_runtime_package_does_not_import_the_harness() -> None:
    users = sorted(
        str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if "cbgen_bench" in path.read_text()
    )
    assert users == ["cli.py"]
    assert not (SRC / "bench").exists()
