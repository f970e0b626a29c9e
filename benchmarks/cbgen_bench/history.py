"""Keeps a results folder small: every run becomes one line of ``history.jsonl`` holding its key numbers,
and only the newest runs keep their files (JSON report, markdown table, chart, step profile), at most
:data:`MAX_RESULT_FILES` files in the folder, ``history.jsonl`` included.

``cbgen bench`` calls :func:`prune` on its ``--out`` folder after writing each report, so the history
grows by one line per run and the folder stays within the limit (the newest run keeps its files
whatever the limit, and files that are not a run's are never deleted).  By hand::

    python -m cbgen_bench.history                    # prune benchmarks/results/
    python -m cbgen_bench.history --dry-run DIR      # only say what would happen

A history line holds the run's id (``bench-<stamp>``), start time, CPU (name, vector features, cores,
threads), dtype, repeats, neighbour and command line; per workload the matmul ceiling, the
``cbgen/<engine>`` ratios, and per engine the median wall seconds and the wall seconds of each round,
output tokens/s, time to first token, share of the ceiling, token agreement, peak memory and error;
cold-start totals; the ``long`` cases (bounds, ms per decode token, time to first token); the
null-model rows; and the report's problems.  Per-step profiles stay out of it: they are dropped with
their run's files.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HISTORY_NAME = "history.jsonl"
# benchmarks/results stays reviewable in a diff: the newest few runs as files, the rest as lines.
# tests/test_docs.py holds the repository's own results folder to this limit.
MAX_RESULT_FILES = 16
# Every file a run writes is named by its stamp (``YYYYmmdd-HHMMSS``, which sorts by time).
_RUN_FILE = re.compile(r"^(?:bench|profile)-(\d{8}-\d{6})\.(?:json|md|png)$")
_ENGINE_FIELDS = ("output_tok_s", "wall_s")
_ENGINE_EXTRAS = (
    "ttft_p50_s",
    "pct_of_ceiling",
    "tokens_match",
    "peak_memory_bytes",
    "prefix_cache_hit_rate",
)
# Six significant digits lie far below the runs' noise and keep every number the docs quote; a
# float's full repr (17 digits) would only lengthen the lines.
_DIGITS = 6


@dataclass
class PrunePlan:
    """What one prune does: stamps (``YYYYmmdd-HHMMSS``) whose files stay, stamps whose files are
    deleted (their history line stays), and stamps whose line it adds to the history."""

    kept: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)


def _compact(value: Any) -> Any:
    """``value`` with every float rounded to :data:`_DIGITS` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{_DIGITS}g}")
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def _median(value: Any) -> Any:
    # Engine statistics are {"median", "min", "max"} dicts; older reports may hold plain numbers.
    return value.get("median") if isinstance(value, dict) else value


def _engine_numbers(engine: dict[str, Any]) -> dict[str, Any]:
    out = {name: _median(engine.get(name)) for name in _ENGINE_FIELDS}
    rounds = [run["wall_s"] for run in engine.get("runs") or [] if isinstance(run, dict) and "wall_s" in run]
    if len(rounds) > 1:  # one round is the median already
        out["rounds_wall_s"] = rounds
    for name in (*_ENGINE_EXTRAS, "error"):
        if engine.get(name) is not None:
            out[name] = engine[name]
    return out


def _workload_numbers(workload: dict[str, Any]) -> dict[str, Any]:
    ceiling = workload.get("matmul_ceiling") or {}
    out: dict[str, Any] = {
        "model": workload.get("model"),
        "ceiling_s": ceiling.get("ceiling_s"),
        "ratios": workload.get("ratios", {}),
        "engines": {name: _engine_numbers(e) for name, e in workload.get("engines", {}).items()},
    }
    cold = (workload.get("cold_start") or {}).get("engines")
    if cold:
        out["cold_start_total_s"] = {name: e.get("total_s") for name, e in cold.items()}
    return out


def _long_numbers(long: dict[str, Any]) -> dict[str, Any]:
    cases = {}
    for case in long.get("cases", []):
        bound = case.get("bound", {})
        cases[case["name"]] = {
            "bound_decode_ms": bound.get("decode_ms"),
            "bound_prefill_s": bound.get("prefill_s"),
            "engines": {
                name: {"decode_ms_per_token": e.get("decode_ms_per_token"), "ttft_s": e.get("ttft_s")}
                for name, e in case.get("engines", {}).items()
            },
        }
    machine = long.get("machine", {})
    return {"bandwidth_gbs": machine.get("bandwidth_gbs"), "cases": cases}


def summarize_run(stamp: str, report: dict[str, Any]) -> dict[str, Any]:
    """The key numbers of one report, as one JSON-able history record (floats to six digits)."""
    meta = report.get("meta", {})
    record: dict[str, Any] = {"run": f"bench-{stamp}"}
    for name in ("started", "cpu", "cpu_features", "cpu_count", "threads", "dtype", "repeats", "argv"):
        record[name] = meta.get(name)
    for name in ("neighbour", "tiny", "no_check"):
        if meta.get(name):  # absent, None and False all mean the ordinary run
            record[name] = meta[name]
    record["workloads"] = {name: _workload_numbers(w) for name, w in report.get("workloads", {}).items()}
    if "long" in report:
        record["long"] = _long_numbers(report["long"])
    if report.get("null_model"):
        record["null_model"] = report["null_model"]
    record["problems"] = [p.get("message") for p in report.get("problems", [])]
    if report.get("unchecked"):
        record["unchecked"] = report["unchecked"]
    return _compact(record)


def history_line(record: dict[str, Any]) -> str:
    """One compact line of ``history.jsonl`` (keys sorted, so equal records give equal lines)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n"


def recorded_runs(history: Path) -> set[str]:
    """The run ids (``bench-<stamp>``) that ``history`` already holds."""
    if not history.exists():
        return set()
    return {json.loads(line)["run"] for line in history.read_text().splitlines() if line.strip()}


def plan_prune(run_files: dict[str, int], other_files: int, max_files: int) -> list[str]:
    """The stamps whose files stay: the newest runs that fit in ``max_files`` beside ``other_files``.

    ``run_files`` counts the files of each prunable run.  Runs are taken newest first and the first
    that does not fit stops the count, so the kept runs are always the newest ones; the newest run
    stays whatever the limit (``cbgen bench`` has just printed its file names).  ``max_files`` 0
    keeps every run."""
    newest_first = sorted(run_files, reverse=True)
    if max_files <= 0:
        return sorted(newest_first)
    kept: list[str] = []
    total = other_files
    for stamp in newest_first:
        if kept and total + run_files[stamp] > max_files:
            break
        kept.append(stamp)
        total += run_files[stamp]
    return sorted(kept)


def _files_by_stamp(results: Path) -> tuple[dict[str, list[Path]], int]:
    """The folder's run files grouped by stamp, and how many other files it holds."""
    runs: dict[str, list[Path]] = {}
    others = 0
    for path in sorted(results.iterdir()):
        match = _RUN_FILE.match(path.name)
        if match and path.is_file():
            runs.setdefault(match.group(1), []).append(path)
        elif path.is_file():
            others += 1
    return runs, others


def _load_report(path: Path) -> dict[str, Any] | None:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: the run keeps its files rather than lose its numbers
    return report if isinstance(report, dict) else None


def prune(results: Path, max_files: int = MAX_RESULT_FILES, dry_run: bool = False) -> PrunePlan:
    """Appends every run of ``results`` that ``history.jsonl`` lacks to it, then deletes the files of
    all but the newest runs, so the folder holds at most ``max_files`` files.

    A run whose report is missing or unreadable and that the history does not hold keeps its files
    (they count towards the limit).  A run already in the history is not written twice, so pruning
    again is harmless."""
    history = results / HISTORY_NAME
    runs, others = _files_by_stamp(results)
    recorded = recorded_runs(history)
    new_lines: dict[str, str] = {}
    for stamp in sorted(runs):
        if f"bench-{stamp}" in recorded:
            continue
        report = _load_report(results / f"bench-{stamp}.json")
        if report is not None:
            new_lines[stamp] = history_line(summarize_run(stamp, report))
    prunable = {s: len(files) for s, files in runs.items() if s in new_lines or f"bench-{s}" in recorded}
    others += sum(len(files) for s, files in runs.items() if s not in prunable)
    if new_lines and not history.exists():
        others += 1  # the history file this prune creates
    kept = plan_prune(prunable, others, max_files)
    plan = PrunePlan(kept=kept, moved=sorted(set(prunable) - set(kept)), appended=sorted(new_lines))
    if dry_run:
        return plan
    if new_lines:
        with history.open("a", encoding="utf-8") as out:
            out.writelines(new_lines[stamp] for stamp in plan.appended)
    for stamp in plan.moved:
        for path in runs[stamp]:
            path.unlink(missing_ok=True)
    return plan


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cbgen_bench.history``."""
    parser = argparse.ArgumentParser(prog="python -m cbgen_bench.history", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--max-files",
        type=int,
        default=MAX_RESULT_FILES,
        help=f"files the folder may hold, {HISTORY_NAME} included; 0 keeps every run ({MAX_RESULT_FILES})",
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would happen, change nothing")
    args = parser.parse_args(argv)
    plan = prune(args.results, max_files=args.max_files, dry_run=args.dry_run)
    append, keep, delete = (
        ("would append", "would keep", "would delete") if args.dry_run else ("appended", "kept", "deleted")
    )
    history = args.results / HISTORY_NAME
    print(f"{append} {len(plan.appended)} run(s) to {history}: {', '.join(plan.appended)}")
    print(f"{keep} the files of {len(plan.kept)} run(s): {', '.join(plan.kept)}")
    print(f"{delete} the files of {len(plan.moved)} run(s): {', '.join(plan.moved)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
