"""Thin wrapper so the benchmark can be run from a checkout: ``python benchmarks/run.py [options]``.

Same options as ``cbgen bench`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import sys

from cbgen_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
