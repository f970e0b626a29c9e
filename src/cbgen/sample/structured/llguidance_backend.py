"""The llguidance backend (MIT, no dependencies; chosen by measurement, see benchmarks/NOTES.md).

JSON schemas compile with fixed separators (``", "`` and ``": "``) and no free whitespace: small
models otherwise tend to emit whitespace until ``max_tokens`` and leave the JSON unfinished.  A
schema can still ask for other settings through llguidance's ``"x-guidance"`` key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from cbgen.structured_params import StructuredOutputParams

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError as exc:  # pragma: no cover - exercised only without the optional extra
    raise ImportError(
        "structured output needs llguidance: pip install 'cbgen[structured]' (or llguidance==1.9.1)"
    ) from exc

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Matcher:
    """An ``llguidance.LLMatcher`` behind :class:`~cbgen.sample.structured.backend.GrammarMatcher`."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def consume(self, tokens: list[int]) -> bool:
        """Advances over ``tokens``."""
        return bool(self.inner.consume_tokens(tokens))

    def error(self) -> str:
        """The first line of llguidance's error (the rest is a parser state dump)."""
        return self.inner.get_error().split("\n", 1)[0]


class LLGuidanceBackend:
    """llguidance over one Hugging Face fast tokenizer, masks ``vocab_size`` wide."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        try:
            # About a second for a 49k vocabulary: built once per engine, on first use.
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
            )
        except Exception as exc:
            raise ValueError(
                "structured output needs a Hugging Face fast tokenizer (tokenizers-backed); "
                f"llguidance could not read this one: {type(exc).__name__}: {exc}"
            ) from None
        self.vocab_size = vocab_size
        # Rows are filled on llguidance's own threads (Rust, parked when idle).
        self.executor = llguidance.LLExecutor()

    def grammar_text(self, spec: StructuredOutputParams) -> str:
        """The llguidance grammar for ``spec`` (not yet checked)."""
        kind = spec.kind
        matcher = llguidance.LLMatcher
        if kind == "json":
            schema = spec.json
            return matcher.grammar_from_json_schema(
                schema if isinstance(schema, str) else json.dumps(schema), defaults=_JSON_OPTIONS
            )
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            # Lark string literals take JSON escapes, so any string is one literal.
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return matcher.grammar_from_lark(spec.grammar)

    def compile(self, spec: StructuredOutputParams) -> Any:
        """A matcher at the grammar's start, kept as the template later matchers are copied from."""
        try:
            text = self.grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"SamplingParams.structured_output.{spec.kind}: {exc}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise ValueError(f"SamplingParams.structured_output.{spec.kind}: {problem.strip()}")
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(
                f"SamplingParams.structured_output.{spec.kind}: {template.get_error().splitlines()[0]}"
            )
        return template

    def new_matcher(self, compiled: Any) -> _Matcher:
        """A copy of the template (microseconds; compiling again would take milliseconds)."""
        return _Matcher(compiled.deep_copy())

    def fill(self, matchers: Sequence[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call, spread over llguidance's threads."""
        if matchers:
            pairs = [(m.inner, i) for m, i in matchers]
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


__all__ = ["LLGuidanceBackend"]
