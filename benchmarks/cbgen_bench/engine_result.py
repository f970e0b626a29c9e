"""What an engine run produced: :class:`RunRecord` per timed run, :class:`EngineResult` per engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunRecord:
    """One timed run of a whole workload.  ``tokens`` (``[request][sample]`` ids) and, from engines
    that report them, ``raw_logprobs`` (same shape) are kept per run, because every repeat is checked,
    not only the last."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float] | None = None
    stats: dict[str, Any] | None = None
    phase_s: dict[str, float] | None = None
    tokens: list[list[list[int]]] | None = None
    raw_logprobs: list[list[list[float]]] | None = None


@dataclass
class EngineResult:
    """What one engine did on one workload over all repeats."""

    engine: str
    workload: str
    runs: list[RunRecord] = field(default_factory=list)
    tokens: list[list[list[int]]] | None = None  # [request][sample] -> ids, from the last run
    peak_memory_bytes: int | None = None
    memory_kind: str = "rss"  # "rss" | "cuda"
    isolated: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] | None = None  # per-step records of the last run (--profile)
    error: str | None = None
    # Sampled workloads: per run, the check of its tokens against a plain forward (logprob_check.py).
    sample_checks: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineResult:
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["runs"] = [RunRecord(**r) for r in data.get("runs", [])]
        return cls(**data)


def merge_results(parts: list[EngineResult]) -> EngineResult:
    """Combines one engine's results from several calls (one per round) into one result."""
    first = parts[0]
    ok = [p for p in parts if p.error is None]
    merged = EngineResult(
        first.engine,
        first.workload,
        runs=[run for p in parts for run in p.runs],
        tokens=ok[-1].tokens if ok else None,
        memory_kind=first.memory_kind,
        isolated=all(p.isolated for p in parts),
        settings=first.settings,
        notes=list(dict.fromkeys(n for p in parts for n in p.notes)),
        steps=next((p.steps for p in reversed(parts) if p.steps), None),
        error=next((p.error for p in parts if p.error), None),
    )
    peaks = [p.peak_memory_bytes for p in parts if p.peak_memory_bytes]
    merged.peak_memory_bytes = max(peaks) if peaks else None
    return merged


__all__ = ["EngineResult", "RunRecord", "merge_results"]
