"""Keeps ``benchmarks/results/`` small: the latest run per (workloads, CPU, dtype) stays as files, and
each older run becomes one line of ``history.jsonl`` holding its key numbers.

    python -m cbgen_bench.history                    # prune benchmarks/results/
    python -m cbgen_bench.history --dry-run DIR      # only say what would move

A history line holds the run's stamp, start time, CPU (name, vector features, cores, threads), dtype,
repeats and command line; per workload the matmul ceiling, the ``cbgen/<engine>`` ratios, and per
engine the median wall seconds, output tokens/s, share of the ceiling, token agreement, peak memory
and error; cold-start totals; the ``long`` cases (bounds, ms per decode token, time to first token);
the null-model rows; and the report's problems.  The per-run profile files are dropped with their run.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HISTORY_NAME = "history.jsonl"
_STAMP = re.compile(r"^bench-(\d{8}-\d{6})\.json$")
# Every file a run writes, by stamp.
_RUN_FILES = ("bench-{}.json", "bench-{}.md", "bench-{}.png", "profile-{}.json")
_ENGINE_FIELDS = ("output_tok_s", "wall_s")


@dataclass(frozen=True)
class RunKey:
    """What makes two runs comparable: only the latest run of each key keeps its files."""

    workloads: str
    cpu: str
    dtype: str


@dataclass
class PrunePlan:
    """Stamps (``YYYYmmdd-HHMMSS``) kept as files and stamps moved into the history."""

    kept: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)


def run_key(report: dict[str, Any]) -> RunKey:
    """The (workload set, CPU, dtype) of a ``cbgen bench`` report."""
    meta = report.get("meta", {})
    names = sorted(report.get("workloads", {}))
    if "long" in report:
        names.append("long")
    if report.get("null_model"):
        names.append("null-model")
    workloads = ",".join(names) + (" (tiny)" if meta.get("tiny") else "")
    return RunKey(workloads=workloads, cpu=str(meta.get("cpu")), dtype=str(meta.get("dtype")))


def _median(value: Any) -> Any:
    # Engine statistics are {"median", "min", "max"} dicts; older reports may hold plain numbers.
    return value.get("median") if isinstance(value, dict) else value


def _engine_numbers(engine: dict[str, Any]) -> dict[str, Any]:
    out = {name: _median(engine.get(name)) for name in _ENGINE_FIELDS}
    for name in ("pct_of_ceiling", "tokens_match", "peak_memory_bytes", "prefix_cache_hit_rate", "error"):
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
    """The key numbers of one report, as one JSON-able history record."""
    meta = report.get("meta", {})
    record: dict[str, Any] = {"run": f"bench-{stamp}"}
    for name in ("started", "cpu", "cpu_features", "cpu_count", "threads", "dtype", "repeats", "argv"):
        record[name] = meta.get(name)
    record["workloads"] = {name: _workload_numbers(w) for name, w in report.get("workloads", {}).items()}
    if "long" in report:
        record["long"] = _long_numbers(report["long"])
    if report.get("null_model"):
        record["null_model"] = report["null_model"]
    record["problems"] = [p.get("message") for p in report.get("problems", [])]
    return record


def plan_prune(reports: dict[str, dict[str, Any]]) -> PrunePlan:
    """Which stamps keep their files: the newest of each :class:`RunKey`; every other stamp moves."""
    newest: dict[RunKey, str] = {}
    for stamp in sorted(reports):  # stamps sort by time
        newest[run_key(reports[stamp])] = stamp
    kept = set(newest.values())
    return PrunePlan(kept=sorted(kept), moved=sorted(set(reports) - kept))


def load_reports(results: Path) -> dict[str, dict[str, Any]]:
    """Every ``bench-<stamp>.json`` report in ``results``, by stamp."""
    reports = {}
    for path in sorted(results.iterdir()):
        match = _STAMP.match(path.name)
        if match:
            reports[match.group(1)] = json.loads(path.read_text())
    return reports


def _recorded_runs(history: Path) -> set[str]:
    if not history.exists():
        return set()
    return {json.loads(line)["run"] for line in history.read_text().splitlines() if line.strip()}


def prune(results: Path, dry_run: bool = False) -> PrunePlan:
    """Appends every run but the newest of its key to ``results/history.jsonl`` and deletes its files.

    A run already in the history is not written twice, so pruning again is harmless."""
    reports = load_reports(results)
    plan = plan_prune(reports)
    if dry_run:
        return plan
    history = results / HISTORY_NAME
    recorded = _recorded_runs(history)
    with history.open("a", encoding="utf-8") as out:
        for stamp in plan.moved:
            if f"bench-{stamp}" not in recorded:
                out.write(json.dumps(summarize_run(stamp, reports[stamp]), sort_keys=True) + "\n")
    for stamp in plan.moved:
        for pattern in _RUN_FILES:
            (results / pattern.format(stamp)).unlink(missing_ok=True)
    return plan


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cbgen_bench.history``."""
    parser = argparse.ArgumentParser(prog="python -m cbgen_bench.history", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--dry-run", action="store_true", help="list what would move, change nothing")
    args = parser.parse_args(argv)
    plan = prune(args.results, dry_run=args.dry_run)
    verb = "would move" if args.dry_run else "moved"
    print(f"kept {len(plan.kept)} run(s): {', '.join(plan.kept)}")
    print(f"{verb} {len(plan.moved)} run(s) into {args.results / HISTORY_NAME}: {', '.join(plan.moved)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
