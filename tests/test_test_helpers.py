"""The suite's own helpers: optional extras (``tests/extras.py``) and the run's GEMM summary
(``tests/native_paths.py``)."""

from __future__ import annotations

import json

import pytest

import native_paths
from extras import require_extra


def test_a_present_extra_is_imported(monkeypatch) -> None:
    monkeypatch.setenv("CBGEN_REQUIRE_EXTRAS", "1")
    assert require_extra("json") is json


def test_a_missing_extra_skips_naming_it(monkeypatch) -> None:
    monkeypatch.delenv("CBGEN_REQUIRE_EXTRAS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="extra 'cbgen\\[ray\\]'"):
        require_extra("ray.no_such_module")


def test_a_missing_extra_fails_under_make_test(monkeypatch) -> None:
    """``CBGEN_REQUIRE_EXTRAS=1`` (the Makefile's test targets): a failure naming the extra."""
    monkeypatch.setenv("CBGEN_REQUIRE_EXTRAS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"no_such_extra_module.*CBGEN_REQUIRE_EXTRAS=1"):
        require_extra("no_such_extra_module")


def test_gemm_summary_lines_add_up_outcomes_and_paths(tmp_path) -> None:
    cover = native_paths.GemmCoverage()
    cover.add(("float32", "panel", ["panel: single, decode", "C step panel: single"]), "passed")
    cover.add(("float32", "panel", ["panel: single, decode, prefill"]), "failed")
    cover.add(("bfloat16", "plain", ["plain"]), "passed")
    lines = cover.lines()
    assert len(lines) == 2 and lines[0].startswith("bfloat16") and "1 passed" in lines[0]
    assert "1 failed, 1 passed" in lines[1] and "C step panel: single" in lines[1]
    assert native_paths.measured_gemm_choices(tmp_path) == []
    entry = {"single": "gemv", "decode": "panel", "prefill": "plain", "dtype": "torch.float32"}
    (tmp_path / "gemm-choice.json").write_text(json.dumps({"k1": entry}))
    assert native_paths.measured_gemm_choices(tmp_path) == [
        "torch.float32   k1: single gemv, decode panel, prefill plain"
    ]
