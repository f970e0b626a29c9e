"""Structured output: grammar-constrained sampling behind a thin backend interface.

:class:`StructuredOutputs` (in :mod:`.masks`) is what the engine and the sampler use;
:mod:`.backend` is the seam a grammar library plugs into (llguidance today).
"""

from cbgen.sample.structured.backend import BACKENDS, DEFAULT_BACKEND, GrammarBackend, GrammarMatcher
from cbgen.sample.structured.masks import MatcherState, StructuredOutputs

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "GrammarBackend",
    "GrammarMatcher",
    "MatcherState",
    "StructuredOutputs",
]
