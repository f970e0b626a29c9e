"""Every environment variable cbgen reads, declared in one place with its default and meaning.

Code reads them through :func:`get` (or the typed helpers below), never through ``os.environ``
directly, so this table is the complete list; ``cbgen serve --help`` and the README point here.
Variables of other tools that cbgen honours (``CC``, ``XDG_CACHE_HOME``, ``TRITON_INTERPRET``) are
listed too, since they change what cbgen does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, its default (None: unset) and what it does."""

    name: str
    default: str | None
    help: str


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("CBGEN_MODEL_DIR", None, "where the default model is converted to (default: the user cache)"),
        EnvVar("CBGEN_KERNEL_DIR", None, "where the C kernels are built (default: ~/.cache/cbgen/kernels)"),
        EnvVar("CBGEN_AMX", "1", "0 keeps the bf16 projections off AMX even where the CPU has it"),
        EnvVar("CBGEN_SANITIZE", "", "'address' builds the C kernels with AddressSanitizer (tests only)"),
        EnvVar(
            "CBGEN_GEMM",
            "",
            "projection GEMMs instead of the measured choice: decode=NAME,prefill=NAME or one NAME "
            "(plain, mkl_packed, onednn_packed, amx)",
        ),
        EnvVar(
            "CBGEN_DECODE_LOOPS",
            "",
            "the C decode-attention loops instead of the measured choice: avx512, avx2, portable or "
            "widest (the widest this build has)",
        ),
        EnvVar(
            "CBGEN_PARITY_KERNELS",
            "auto",
            "parity mode's kernels instead of the automatic choice: c, triton (CUDA, or the interpreter) "
            "or torch; both sides of parity must run under the same setting",
        ),
        EnvVar(
            "CBGEN_STATE_KERNELS",
            "1",
            "0 runs the state mixers' arithmetic in transformers' torch functions instead of cbgen's C "
            "kernels (same bits, slower)",
        ),
        EnvVar(
            "CBGEN_REQUIRE_KERNELS",
            "0",
            "1 makes a failed C kernel build an error instead of a fallback to torch (`make test` sets it)",
        ),
        EnvVar(
            "CBGEN_FOLLOW_LOAD",
            "1",
            "0 keeps CPU steps on torch's thread count even while other processes hold cores "
            "(by default a step runs on one thread fewer per core a neighbour keeps busy)",
        ),
        EnvVar("CBGEN_LOG_LEVEL", "INFO", "level of cbgen's own log handler when no handler is configured"),
        EnvVar("CBGEN_API_KEY", None, "API key of `cbgen serve` (keeps it out of the process list)"),
        EnvVar("CC", None, "C compiler for the CPU kernels (default: cc, then gcc)"),
        EnvVar("XDG_CACHE_HOME", None, "base of the default cache folders"),
        EnvVar("TRITON_INTERPRET", "0", "1 runs the Triton kernels in Triton's CPU interpreter (tests)"),
    )
}


def get(name: str) -> str | None:
    """The variable's value, or its declared default; an undeclared name is a bug."""
    var = VARIABLES[name]
    value = os.environ.get(name)
    return value if value is not None and value != "" else var.default


def flag(name: str) -> bool:
    """A variable read as a switch: 1/true/on/yes."""
    return (get(name) or "").strip().lower() in {"1", "true", "on", "yes"}
