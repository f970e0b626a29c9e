"""The seam between the engine and a grammar library.

A backend compiles a :class:`~cbgen.structured_params.StructuredOutputParams` into a grammar once,
hands out a fresh matcher per sequence, and fills many matchers' next-token bitmasks in one call
(``[rows, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed).
Everything else (which matcher belongs to which sequence, keeping it in step with the sequence's
tokens, applying the masks to the logits) lives in :mod:`cbgen.sample.structured.masks` and is the
same for every backend.  llguidance is the one implemented; a second one (xgrammar, outlines-core)
implements these two protocols and registers a factory in :data:`BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from cbgen.structured_params import StructuredOutputParams


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def consume(self, tokens: list[int]) -> bool:
        """Advances over ``tokens``; False (and the matcher stays failed) if one is not allowed."""
        ...

    def error(self) -> str:
        """Why the matcher failed, or an empty string."""
        ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer and vocabulary width."""

    name: str

    def compile(self, spec: StructuredOutputParams) -> Any:
        """The compiled grammar; raises ``ValueError`` naming the problem if it does not compile,
        or if it breaks a limit of the library that a request would only meet on its first
        tokens (a library that reports limits lazily must look for them here)."""
        ...

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of ``compiled``."""
        ...

    def fill(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Writes each matcher's allowed next tokens into row ``index`` of the CPU int32 ``bitmask``.

        A finished grammar allows only the EOS tokens the backend was built with."""
        ...


# name -> factory(tokenizer, vocab_size, eos_token_ids).  Imports of the libraries happen inside the
# factories: they are optional dependencies, needed only once a request asks for structured output.
BackendFactory = Callable[[Any, int, Sequence[int]], GrammarBackend]


def _llguidance(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
    from cbgen.sample.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)


BACKENDS: dict[str, BackendFactory] = {"llguidance": _llguidance}
DEFAULT_BACKEND = "llguidance"


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendFactory", "GrammarBackend", "GrammarMatcher"]
