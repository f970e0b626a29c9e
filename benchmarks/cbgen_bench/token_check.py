"""The greedy token check: every run's tokens against the reference engine's, sequence by sequence."""

from __future__ import annotations

from cbgen_bench.engine_result import EngineResult
from cbgen_bench.engine_settings import REFERENCE_ENGINE


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


def run_tokens(result: EngineResult) -> list[list | None]:
    """Each run's tokens (a result without per-run tokens counts as one run with its last tokens)."""
    per_run = [run.tokens for run in result.runs]
    return per_run if per_run and all(t is not None for t in per_run) else [result.tokens]


def check_runs(
    label: str, result: EngineResult, reference: EngineResult, dtype: str
) -> tuple[float | str | None, list[tuple[str, str]]]:
    """Every run of ``result`` against the reference's first run (the reference's own runs against
    each other): the smallest match fraction (``"reference"`` for the reference itself) and the
    problems, each naming its run."""
    expected = run_tokens(reference)[0]
    runs = run_tokens(result)
    is_reference = result is reference
    problems: list[tuple[str, str]] = []
    worst: float | None = None
    for i, tokens in enumerate(runs[1:] if is_reference else runs, start=2 if is_reference else 1):
        where = f"{label} (run {i} of {len(runs)})" if len(runs) > 1 else label
        match, found = check_tokens(where, tokens, expected, dtype)
        problems += found
        if match is not None:
            worst = match if worst is None else min(worst, match)
    return ("reference" if is_reference else worst), problems


__all__ = ["check_runs", "check_tokens", "run_tokens", "tokens_match"]
