"""Tests of optional extras: a missing extra skips the tests that need it, except under ``make test``.

``make test`` installs every extra, so there a missing one is a broken install, not a reason to skip:
with ``CBGEN_REQUIRE_EXTRAS=1`` (the Makefile sets it) :func:`require_extra` fails the test, or the
module's collection, naming the extra.  Without it (someone running a subset in a leaner venv) it
skips, naming the extra to install.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# The pyproject extra that installs each module the tests import conditionally.
EXTRAS = {
    "datasets": "cbgen[trl]",
    "llguidance": "cbgen[structured]",
    "openai": "cbgen[dev]",
    "peft": "cbgen[dev]",
    "ray": "cbgen[ray]",
    "triton": "cbgen[triton]",
    "trl": "cbgen[trl]",
    "uvicorn": "cbgen",
}


def required() -> bool:
    """Whether a missing extra fails instead of skipping (``CBGEN_REQUIRE_EXTRAS=1``)."""
    return os.environ.get("CBGEN_REQUIRE_EXTRAS", "").strip().lower() in {"1", "true", "on", "yes"}


def require_extra(module: str) -> ModuleType:
    """``module``, imported; where it does not import, a skip of the calling test or module naming
    its extra, or a failure with ``CBGEN_REQUIRE_EXTRAS=1``.  Works at module level and in tests."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module.split(".")[0], module)
        what = f"{module}, from the extra {extra!r}, does not import ({exc})"
        if required():
            pytest.fail(
                f"{what}; CBGEN_REQUIRE_EXTRAS=1 (make test) makes that a failure, unset it to skip",
                pytrace=False,
            )
        pytest.skip(what, allow_module_level=True)
