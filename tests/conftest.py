"""Shared fixtures, markers and the run's native-path report.

The real SmolLM2-135M-Instruct model is converted from its bundled GGUF once, into the default
location (``$CBGEN_MODEL_DIR`` or the user cache), so every test module and every later run
reuses the same folder instead of paying for the conversion again.

``@pytest.mark.native("avx512", ...)`` marks a test of a native code path (``tests/native_paths.py``):
it is skipped, with the path named and the reason, where this machine lacks that path.  With
``CBGEN_REQUIRE_KERNELS=1`` (``make test``) a failed C build ends the run at once with the build
error instead of turning the kernel tests into skips.  The terminal summary says which paths ran.

``@pytest.mark.cuda`` marks a test that needs a CUDA device with compiled (not interpreted) Triton
kernels: ``CBGEN_TEST_CUDA=1 pytest -m cuda`` on a GPU machine (``benchmarks/gpu_check.py`` does).

**Hermetic kernel choice.**  The run builds its C kernels into, and measures its GEMM choices in, a
directory of its own (``CBGEN_KERNEL_DIR``, made when this file is imported, before anything builds;
subprocesses inherit it; removed at the end), never ``~/.cache/cbgen``: a choice timed by an earlier
run or by the user's engines cannot change which GEMM a test runs.  Nor can this run's own timings:
tests that do not claim a GEMM run on one fixed choice, ``CBGEN_GEMM=panel`` for every row class
(``plain`` on CPUs without AVX2 + FMA), and on the widest decode-attention loops the build has
(``CBGEN_DECODE_LOOPS=widest``), so two runs on one machine run the same kernel paths (a timed
choice could flip between two GEMMs a few percent apart).  Tests that claim a GEMM force their own,
and the tests of the measured choice itself (``test_gemm_choice.py``, ``test_plan.py``) unset it.
The summary lists the GEMM candidates the exactness tests ran and the choices measured during the
run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

# This run's own kernel and GEMM-choice directory (module docstring), before anything can build.
os.environ["CBGEN_KERNEL_DIR"] = tempfile.mkdtemp(prefix="cbgen-test-kernels-")

# Triton decides between compiling and interpreting when a kernel is first decorated, and other
# tests (torch.compile) may import triton before the kernel tests do.  CI has no GPU, so every
# Triton kernel in this process must run in the interpreter: decide it before anything imports triton.
if os.environ.get("CBGEN_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import native_paths
import oracle

_KERNEL_DIR = os.environ["CBGEN_KERNEL_DIR"]

# Per native path: outcomes of the tests marked with it, and which paths each test id covers.
_OUTCOMES: dict[str, Counter] = {path: Counter() for path in native_paths.PATHS}
_PATHS_OF: dict[str, tuple[str, ...]] = {}
_SKIPPED_FOR: dict[str, tuple[str, ...]] = {}  # test id -> the missing paths it was skipped for
_GEMMS = native_paths.GemmCoverage()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "native(*paths): tests a native code path of tests/native_paths.py")
    config.addinivalue_line("markers", "cuda: needs a CUDA device and compiled Triton (CBGEN_TEST_CUDA=1)")


def pytest_sessionstart(session: pytest.Session) -> None:
    from cbgen import envs
    from cbgen.model.kernels.cpu import ops as cpu_kernels
    from cbgen.model.kernels.cpu.panel import panel_available

    if envs.flag("CBGEN_REQUIRE_KERNELS"):
        try:
            cpu_kernels.available()
        except cpu_kernels.KernelsRequiredError as err:
            pytest.exit(
                f"{err}\n(unset CBGEN_REQUIRE_KERNELS to run the torch fallback instead)", returncode=3
            )
    # One GEMM for every test that does not claim one (module docstring), set before any engine
    # exists so subprocesses (torchrun, Ray, the server) inherit it too.
    os.environ.setdefault("CBGEN_GEMM", "panel" if panel_available() else "plain")
    # Likewise one set of decode-attention loops: the widest the build has (the kernel tests run
    # each set against the reference; test_decode_loops.py unsets it to test the measurement).
    os.environ.setdefault("CBGEN_DECODE_LOOPS", "widest")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        paths = tuple(p for mark in item.iter_markers("native") for p in mark.args)
        unknown = set(paths) - set(native_paths.PATHS)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: unknown native path(s) {sorted(unknown)}")
        if not paths:
            continue
        _PATHS_OF[item.nodeid] = paths
        states = native_paths.states()
        missing = tuple(p for p in paths if not states[p].runs)
        if missing:
            name, why = native_paths.PATHS[missing[0]], states[missing[0]].why_not
            item.add_marker(pytest.mark.skip(reason=f"{name} path not on this machine: {why}"))
            _SKIPPED_FOR[item.nodeid] = missing


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A test counts once: by its call, or by its setup when that skipped or failed it.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        paths = _PATHS_OF.get(report.nodeid, ())
        if report.skipped and report.nodeid in _SKIPPED_FOR:
            paths = _SKIPPED_FOR[report.nodeid]  # not a skip of the paths this machine has
        for path in paths:
            _OUTCOMES[path][report.outcome] += 1
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "gemm_ran":
                _GEMMS.add(value, report.outcome)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Which native paths and GEMMs this run exercised: the claim a green run makes about the C
    kernels."""
    _native_summary(terminalreporter)
    if _GEMMS.ran:
        terminalreporter.section("GEMM candidates run by the exactness tests (forced via CBGEN_GEMM)")
        for line in _GEMMS.lines():
            terminalreporter.write_line(line)
    terminalreporter.section("GEMM of every test that does not force one")
    terminalreporter.write_line(f"CBGEN_GEMM={os.environ.get('CBGEN_GEMM', '(unset: measured)')}")
    measured = native_paths.measured_gemm_choices(_KERNEL_DIR)
    if measured:
        terminalreporter.section("GEMM choices measured in this run (single, decode, prefill)")
        for line in measured:
            terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_KERNEL_DIR, ignore_errors=True)


def _native_summary(terminalreporter) -> None:
    outcomes = _OUTCOMES
    if not any(outcomes.values()):
        return
    from cbgen import envs

    mode = "required" if envs.flag("CBGEN_REQUIRE_KERNELS") else "optional (CBGEN_REQUIRE_KERNELS unset)"
    terminalreporter.section(f"native paths (C kernels {mode})")
    states = native_paths.states()
    for path, name in native_paths.PATHS.items():
        counts = outcomes[path]
        ran = "RAN" if states[path].runs and counts["passed"] + counts["failed"] else "NOT RUN"
        tally = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests selected"
        why = f" ({states[path].why_not})" if states[path].why_not else ""
        terminalreporter.write_line(f"{name:12} {ran:8} {tally}{why}")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: the suite shares a 2-core machine, where one thread is as
    fast, and fp32 reductions then run in one fixed order."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _near_tie_budget():
    """Each test gets its own near-tie count (``tests/oracle.py``: at most one per test in fp32)."""
    oracle.reset_near_ties()
    yield


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Folder holding the converted SmolLM2-135M-Instruct model (float32 safetensors + tokenizer)."""
    from cbgen.model.loading.loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_path(smollm2_path: Path) -> Path:
    """Alias of ``smollm2_path``: the default model folder that ``load_model(None)`` uses."""
    return smollm2_path
