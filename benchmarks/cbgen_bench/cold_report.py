"""The ``cold_start`` section of a workload's report: phases, token checks and speedups per engine."""

from __future__ import annotations

from typing import Any

from cbgen_bench.cold_start import ColdRun, ColdStartResult, marks_ordered, median_phases
from cbgen_bench.engine_result import EngineResult
from cbgen_bench.engine_settings import REFERENCE_ENGINE
from cbgen_bench.token_check import check_tokens
from cbgen_bench.workloads import Workload


def summarize_cold_start(
    workload: Workload,
    cold: dict[str, ColdStartResult],
    dtype: str,
    warm_reference: EngineResult | None = None,
    folder: str | None = None,
) -> dict[str, Any]:
    """The ``cold_start`` section of one workload: per engine the median seconds of each phase
    (:data:`cbgen_bench.cold_start.PHASES`), the runs, token checks and ``cbgen_speedup`` (the engine's
    median total over cbgen's).  Problems (``{"level", "message"}``) are left under the ``problems``
    key for :func:`~cbgen_bench.report.summarize`, and their levels under each row's ``flags``.

    Greedy tokens are checked against the cold ``hf-generate`` run, or the warm one if the cold one
    did not run, so that no cold-start number comes from wrong output.
    """
    problems: list[dict[str, str]] = []
    ref_engine = cold.get(REFERENCE_ENGINE)
    reference, ref_label = None, None
    if ref_engine is not None and ref_engine.error is None and ref_engine.tokens is not None:
        reference, ref_label = ref_engine.tokens, f"{REFERENCE_ENGINE} (cold)"
    elif warm_reference is not None and warm_reference.error is None and warm_reference.tokens is not None:
        reference, ref_label = warm_reference.tokens, f"{REFERENCE_ENGINE} (warm run)"
    rows = {
        engine: _engine_row(workload, engine, result, dtype, reference, result is ref_engine, problems)
        for engine, result in cold.items()
    }
    cb_total = rows.get("cbgen", {}).get("total_s")
    for engine, row in rows.items():
        total = row.get("total_s")
        row["cbgen_speedup"] = total / cb_total if engine != "cbgen" and total and cb_total else None
    return {
        "folder": folder,
        "engines": rows,
        "correctness": {
            "reference": ref_label if workload.greedy else "plain forward (sample of sequences)",
            "checked": bool(reference is not None)
            if workload.greedy
            else all(r.sample_checks for r in cold.values() if r.runs),
        },
        "problems": problems,
    }


def _engine_row(
    workload: Workload,
    engine: str,
    result: ColdStartResult,
    dtype: str,
    reference: list | None,
    is_reference: bool,
    problems: list[dict[str, str]],
) -> dict[str, Any]:
    """One engine's row; its problems are appended to ``problems`` and their levels to its ``flags``."""
    row: dict[str, Any] = {
        "engine": engine,
        "error": result.error,
        "repeats": len(result.runs),
        "settings": result.settings,
        "notes": list(result.notes),
        "runs": [],
    }
    label = f"{workload.name}/{engine} cold start"

    def flag(level: str, message: str) -> None:
        problems.append({"level": level, "message": message})
        row.setdefault("flags", []).append(level)

    if result.error:
        flag("FAIL", f"{label}: {result.error}")
        if not result.runs:
            return row
    for run in result.runs:
        row["runs"].append(_run_entry(run))
        if run.output_tokens != workload.output_tokens:
            flag("FAIL", f"{label}: produced {run.output_tokens} tokens, expected {workload.output_tokens}")
        if not marks_ordered(run.spawn, run.marks):
            # A clock step (NTP) between two marks: the phases of this run are meaningless.
            flag("WARN", f"{label}: timestamps out of order {run.marks}")
    row.update(median_phases(result.runs))
    totals = [r["total_s"] for r in row["runs"] if r["total_s"] is not None]
    row["total_s_min"] = min(totals) if totals else None
    row["total_s_max"] = max(totals) if totals else None
    row["output_tokens"] = result.runs[-1].output_tokens if result.runs else None
    peaks = [r.peak_rss_bytes for r in result.runs if r.peak_rss_bytes]
    row["peak_rss_bytes"] = max(peaks) if peaks else None
    row["tokens_match"] = None
    if workload.greedy and reference is not None:
        row["tokens_match"] = "reference" if is_reference else None
        runs = [r.tokens for r in result.runs] if all(r.tokens for r in result.runs) else [result.tokens]
        for i, tokens in enumerate(runs, start=1):
            where = f"{label} (run {i} of {len(runs)})" if len(runs) > 1 else label
            match, found = check_tokens(where, tokens, reference, dtype)
            for level, message in found:
                flag(level, message)
            if not is_reference and match is not None:
                row["tokens_match"] = (
                    match if row["tokens_match"] is None else min(row["tokens_match"], match)
                )
    for i, check in enumerate(result.sample_checks or [], start=1):
        if not check["ok"]:
            flag(
                "FAIL",
                f"{label} (run {i}): sampled tokens do not fit the model's own forward: z = {check['z']:.1f}",
            )
    return row


def _run_entry(run: ColdRun) -> dict[str, Any]:
    return {
        "spawn": run.spawn,
        "marks": run.marks,
        "exited": run.exited,
        "output_tokens": run.output_tokens,
        "peak_rss_bytes": run.peak_rss_bytes,
        **run.phases(),
    }


__all__ = ["summarize_cold_start"]
