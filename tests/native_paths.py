"""Which native code paths this machine can run, for the ``native`` marker and the run's report.

The C kernels pick their loops at compile time (``-march=native``: ``#if defined(__AVX512F__)`` and
so on), so whether a path exists is a property of the build, asked of the same compiler with the
same flags; AMX also needs the kernel to grant the tile state, which only a call can tell.

* ``c``: the kernels built and loaded at all;
* ``avx2``: the AVX2 + FMA loops of the paged decode kernel (``__AVX2__`` and ``__FMA__``);
* ``avx512``: the AVX-512 loops of the paged decode and fused kernels (``__AVX512F__``);
* ``avx512bf16``: bf16 query x key products on ``vdpbf16ps`` in the decode kernel (``__AVX512BF16__``);
* ``amx``: the bf16 AMX projections and the one-call C decode step.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PATHS: dict[str, str] = {
    "c": "C kernels",
    "avx2": "AVX2",
    "avx512": "AVX-512",
    "avx512bf16": "AVX512-BF16",
    "amx": "AMX",
}
_MACROS = {"avx2": "__FMA__", "avx512": "__AVX512F__", "avx512bf16": "__AVX512BF16__"}


@dataclass(frozen=True)
class PathState:
    """Whether a path runs here, and why not when it does not."""

    runs: bool
    why_not: str | None = None


def _build_macros() -> set[str]:
    """The macros the kernels' compiler predefines with the kernels' flags (``-march=native``)."""
    from cbgen import envs
    from cbgen.model.kernels.cpu import ops as cpu_kernels

    compiler = envs.get("CC") or shutil.which("cc") or shutil.which("gcc")
    flags = [f for f in cpu_kernels._FLAGS if f not in ("-shared", "-fPIC")]
    out = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True, check=True
    )
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}


@functools.cache
def states() -> dict[str, PathState]:
    """Each path of :data:`PATHS` and whether it runs on this machine (asks the compiler once)."""
    from cbgen.model.kernels.cpu import amx as cpu_amx
    from cbgen.model.kernels.cpu import ops as cpu_kernels

    try:
        built = cpu_kernels.available()
    except cpu_kernels.KernelsRequiredError as err:
        built, reason = False, str(err)
    else:
        reason = cpu_kernels.unavailable_reason()
    if not built:
        off = PathState(False, f"the C kernels did not build: {reason}")
        return {path: off for path in PATHS}
    macros = _build_macros()
    result = {"c": PathState(True)}
    for path, macro in _MACROS.items():
        result[path] = (
            PathState(True)
            if macro in macros
            else PathState(False, f"{macro} is not defined for this CPU (-march=native)")
        )
    from cbgen import envs

    if cpu_amx.amx_available():
        result["amx"] = PathState(True)
    elif not {"__AMX_TILE__", "__AMX_BF16__"} <= macros:
        result["amx"] = PathState(False, "__AMX_BF16__ is not defined for this CPU (-march=native)")
    elif envs.get("CBGEN_AMX") == "0":
        result["amx"] = PathState(False, "CBGEN_AMX=0")
    else:
        result["amx"] = PathState(False, "the OS did not grant this process the AMX tile state")
    return result


@dataclass
class GemmCoverage:
    """Which GEMM candidates the exactness tests ran, and how (``tests/test_wide_exactness.py``
    records ``(dtype, forced GEMM, what ran)`` per test as the ``gemm_ran`` user property): the
    summary that lets two runs be compared path by path."""

    ran: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    outcomes: dict[tuple[str, str], Counter] = field(default_factory=dict)

    def add(self, record: tuple[str, str, list[str]], outcome: str) -> None:
        """One test's record and its outcome."""
        dtype, gemm, ran = record
        self.ran.setdefault((dtype, gemm), set()).update(ran)
        self.outcomes.setdefault((dtype, gemm), Counter())[outcome] += 1

    def lines(self) -> list[str]:
        """One line per (dtype, forced GEMM): test outcomes, then each candidate's row classes."""
        out = []
        for key in sorted(self.ran):
            tally = ", ".join(f"{n} {o}" for o, n in sorted(self.outcomes[key].items()))
            dtype, gemm = key
            out.append(f"{dtype:9} {gemm:14} {tally:10} {'; '.join(sorted(self.ran[key]))}")
        return out


def measured_gemm_choices(kernel_dir: str | Path) -> list[str]:
    """The GEMM choices engines measured during this run (``gemm-choice.json`` in the run's kernel
    directory), one line per dtype and projection shapes' key."""
    try:
        stored = json.loads((Path(kernel_dir) / "gemm-choice.json").read_text())
    except (OSError, ValueError):
        return []
    return [
        f"{entry.get('dtype', '?'):15} {key}: "
        + ", ".join(f"{c} {entry.get(c)}" for c in ("single", "decode", "prefill"))
        for key, entry in sorted(stored.items())
    ]
