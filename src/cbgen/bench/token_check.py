"""The greedy token check: an engine's tokens against the reference engine's, sequence by sequence."""

from __future__ import annotations

from cbgen.bench.engine_settings import REFERENCE_ENGINE


def tokens_match(tokens: list | None, reference: list | None) -> float | None:
    """Fraction of sequences (request x sample) identical to the reference's; None if either is missing."""
    if tokens is None or reference is None:
        return None
    pairs = [(a, b) for ra, rb in zip(tokens, reference) for a, b in zip(ra, rb)]
    expected = sum(len(r) for r in reference)
    if not pairs or len(pairs) != expected or len(tokens) != len(reference):
        return 0.0
    return sum(a == b for a, b in pairs) / len(pairs)


def check_tokens(
    label: str, tokens: list | None, reference: list | None, dtype: str
) -> tuple[float | None, list[tuple[str, str]]]:
    """Greedy tokens against the reference's: the match fraction, and a FAIL (float32) or WARN
    (bfloat16) problem labelled ``label`` when they differ."""
    match = tokens_match(tokens, reference)
    if match is None or match >= 1.0:
        return match, []
    level = "FAIL" if dtype == "float32" else "WARN"
    why = "" if level == "FAIL" else " (bf16: near-tie rounding can flip a token)"
    return match, [(level, f"{label}: only {match:.1%} of greedy sequences match {REFERENCE_ENGINE}{why}")]


__all__ = ["check_tokens", "tokens_match"]
