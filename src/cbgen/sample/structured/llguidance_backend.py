"""The llguidance backend (MIT, no dependencies; chosen by measurement, see docs/benchmark_notes.md).

JSON schemas compile with fixed separators (``", "`` and ``": "``) and no free whitespace: small
models otherwise tend to emit whitespace until ``max_tokens`` and leave the JSON unfinished.  A
schema can still ask for other settings through llguidance's ``"x-guidance"`` key.

llguidance checks a grammar's text when it is built, but reports some of its limits only while
computing masks (an Earley row past ``max_items_in_row``, a step past ``step_max_items``, a grammar
that matches nothing).  :meth:`LLGuidanceBackend.compile` therefore also computes the masks of the
grammar's first tokens along a few paths (:func:`_probe`), so such a constraint is refused before
it is queued instead of failing its request after a token or two.  A limit that only a particular
longer output reaches (deep nesting of a recursive schema) can still end that request with
``finish_reason="error"``.
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
# The probe at compile time: masks after 0, 1 and 2 tokens, along this many paths (9 masks, a few
# milliseconds for a JSON schema over a 49k vocabulary; cached with the compiled grammar).
_PROBE_PATHS = 4
_PROBE_DEPTH = 2
# llguidance's stop reasons that, as a matcher's error, mean no text can be generated at all.
_NOTHING = ("NoExtension", "NoExtensionBias")


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
            # One terminal, an alternation of literals (Lark string literals take JSON escapes):
            # the lexer matches it, so the list may be long.  One rule alternative per string
            # would put every string into one Earley row, which llguidance caps at 2,000 items.
            options = " | ".join(json.dumps(c) for c in spec.choice)
            return matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}")
        return matcher.grammar_from_lark(spec.grammar)

    def compile(self, spec: StructuredOutputParams) -> Any:
        """A matcher at the grammar's start, kept as the template later matchers are copied from.

        Raises ``ValueError`` if the grammar does not compile, matches nothing, or hits one of
        llguidance's limits within its first tokens (see :func:`_probe`)."""
        where = f"SamplingParams.structured_output.{spec.kind}"
        try:
            text = self.grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise ValueError(f"{where}: {problem.strip()}")
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"{where}: {_first_line(template.get_error())}")
        problem = _probe(template, self.tokenizer.vocab_size, set(self.tokenizer.eos_tokens))
        if problem:
            raise ValueError(f"{where}: {problem}")
        return template

    def new_matcher(self, compiled: Any) -> _Matcher:
        """A copy of the template (microseconds; compiling again would take milliseconds)."""
        return _Matcher(compiled.deep_copy())

    def fill(self, matchers: Sequence[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call, spread over llguidance's threads."""
        if matchers:
            pairs = [(m.inner, i) for m, i in matchers]
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


def _first_line(error: str) -> str:
    """llguidance's error without the parser state dump that follows its first line."""
    return error.split("\n", 1)[0].strip()


def _probe(template: Any, vocab_size: int, eos: set[int]) -> str:
    """Why ``template``'s first tokens cannot be generated, or an empty string.

    Computes the mask at the start, then after one and two tokens along :data:`_PROBE_PATHS`
    paths (allowed tokens spread over the vocabulary; EOS never, it would end the path), on copies:
    the template stays at the start.  These are the masks a request computes first, so a limit
    llguidance reports only while computing them shows here instead of in a running request."""
    frontier = [template.deep_copy()]
    for depth in range(_PROBE_DEPTH + 1):
        following = []
        for matcher in frontier:
            mask = matcher.compute_bitmask()
            if matcher.is_error():
                return _explained(matcher, depth)
            if depth == _PROBE_DEPTH:
                continue
            tokens = _spread(_allowed(mask, vocab_size, eos), _PROBE_PATHS if depth == 0 else 1)
            for token in tokens:
                step = matcher.deep_copy()
                if not step.consume_token(token):
                    return _explained(step, depth + 1)
                following.append(step)
        frontier = following
    return ""


def _explained(matcher: Any, depth: int) -> str:
    error = _first_line(matcher.get_error())
    if error in _NOTHING:
        return f"the grammar matches no output (llguidance: {error})"
    where = "at the start" if depth == 0 else f"after {depth} token{'s' if depth > 1 else ''}"
    return f"exceeds a limit of the grammar library {where} of the output: {error}"


def _allowed(mask: bytes, vocab_size: int, eos: set[int]) -> list[int]:
    """The tokens set in llguidance's bitmask (bit ``t % 8`` of byte ``t // 8``), EOS left out.

    A plain loop over the non-zero bytes: masks this early are mostly zero, and a torch unpack of
    the whole vocabulary costs more than the masks themselves."""
    return [
        8 * i + bit
        for i, byte in enumerate(mask)
        if byte
        for bit in range(8)
        if byte >> bit & 1 and 8 * i + bit < vocab_size and 8 * i + bit not in eos
    ]


def _spread(tokens: list[int], k: int) -> list[int]:
    """Up to ``k`` of ``tokens``, evenly spaced (deterministic, so a compile is reproducible)."""
    if len(tokens) <= k:
        return tokens
    return [tokens[i * (len(tokens) - 1) // max(k - 1, 1)] for i in range(k)]


__all__ = ["LLGuidanceBackend"]
