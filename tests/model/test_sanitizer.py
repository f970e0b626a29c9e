"""The AddressSanitizer run is live: a C kernel reading past a tensor's end aborts with a report.

``make test-asan`` runs the C kernel tests against a build with ``-fsanitize=address``
(``CBGEN_SANITIZE=address``, the runtime preloaded).  That claim is only worth something if the
library those tests load is instrumented and an out-of-bounds access really stops the run, so this
test makes one: it calls an entry point whose argument check is deliberately bypassed, with a
tensor too short for the call, in a subprocess (the abort ends the process), and expects the
sanitizer's report and a failed exit.  Outside the ASan run it is skipped: the plain build reads the
stray bytes silently, which is what the sanitizer is there to catch.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from cbgen import envs
from cbgen.model.kernels.cpu import ops as cpu_kernels

pytestmark = [
    pytest.mark.native("c"),
    pytest.mark.skipif(
        envs.get("CBGEN_SANITIZE") != "address",
        reason="only in the AddressSanitizer run (make test-asan: CBGEN_SANITIZE=address)",
    ),
]

ROWS, SHORT, WIDTH = 64, 8, 256

# The child: the same library (same flags and kernel directory, inherited), the check that refuses
# a short ``up`` replaced by a no-op, then silu_mul reads ROWS rows of an ``up`` of SHORT rows.
_BYPASSED = f"""
import torch
from cbgen.model.kernels.cpu import ops
assert ops.available()
ops.check_rows = lambda *args, **kwargs: None  # the bypass
gate, out = torch.randn({ROWS}, {WIDTH}), torch.empty({ROWS}, {WIDTH})
up = torch.randn({SHORT}, {WIDTH})
ops.silu_mul(gate, up, out)
print("no abort")
"""


def _short_call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(ROWS, WIDTH), torch.randn(SHORT, WIDTH), torch.empty(ROWS, WIDTH)


def test_the_loaded_library_is_instrumented() -> None:
    """The library this run loaded calls into the sanitizer runtime (the plain build has no
    ``__asan_*`` symbols to resolve)."""
    lib = cpu_kernels.library()
    assert hasattr(lib, "__asan_init") and hasattr(lib, "__asan_report_load4")


def test_the_argument_check_refuses_the_short_tensor() -> None:
    """In process, with its check, the call never reaches C."""
    gate, up, out = _short_call()
    with pytest.raises(ValueError, match="up"):
        cpu_kernels.silu_mul(gate, up, out)


def test_a_bypassed_check_aborts_with_the_sanitizer_report() -> None:
    proc = subprocess.run([sys.executable, "-c", _BYPASSED], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, (
        f"the out-of-bounds read did not abort:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    assert "no abort" not in proc.stdout
    # The first read past the end is in the tensor's redzone; a second thread starting further on
    # may reach a freed block first, which the report then calls a use after free.
    assert re.search(r"ERROR: AddressSanitizer: heap-(buffer-overflow|use-after-free)", proc.stderr), (
        proc.stderr[-3000:]
    )
    # a read, in the kernel (its own frame, or its loop's OpenMP-outlined one when it runs threaded)
    assert "READ of size" in proc.stderr
    assert re.search(r"#\d+ 0x[0-9a-f]+ in (cbgen_)?silu_mul", proc.stderr), proc.stderr[-3000:]
