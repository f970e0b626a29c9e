"""Turns raw engine results into the report: medians, ratios, correctness checks and the JSON file.

Throughput numbers only mean something if the output is right, so every run of every greedy
workload is checked against ``hf-generate`` token for token, every run of a sampled workload against
a plain forward of the model (:mod:`cbgen_bench.logprob_check`), and every engine must produce
exactly the workload's number of tokens.  A failed check becomes a ``problems`` entry, a loud banner
and a ``FAIL`` cell in the table (the markdown and the chart are :mod:`cbgen_bench.report_markdown`
and :mod:`cbgen_bench.report_plot`).  A check that could not run (no ``hf-generate`` in the run) fails
too, unless the run was started with ``--no-check``: then it is listed under ``unchecked`` and the
table says so in its header.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from cbgen_bench.cold_report import summarize_cold_start
from cbgen_bench.engine_result import EngineResult, RunRecord
from cbgen_bench.engine_settings import BASELINES, REFERENCE_ENGINE
from cbgen_bench.token_check import check_runs
from cbgen_bench.workloads import Workload


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_engine(
    result: EngineResult,
    workload: Workload,
    reference: EngineResult | None,
    dtype: str,
    ceiling_s: float | None,
) -> dict[str, Any]:
    """One engine's row: medians with min/max, engine stats, TTFT, memory and correctness."""
    row: dict[str, Any] = {
        "engine": result.engine,
        "error": result.error,
        "settings": result.settings,
        "notes": list(result.notes),
        "isolated": result.isolated,
        "peak_memory_bytes": result.peak_memory_bytes,
        "memory_kind": result.memory_kind,
        "repeats": len(result.runs),
        "runs": [],
        "problems": [],
    }
    label = f"{workload.name}/{result.engine}"
    if result.error:
        row["problems"].append(("FAIL", f"{label}: {result.error}"))
        return row
    for run in result.runs:
        row["runs"].append(_run_entry(run, workload))
        if run.output_tokens != workload.output_tokens:
            row["problems"].append(
                ("FAIL", f"{label}: produced {run.output_tokens} tokens, expected {workload.output_tokens}")
            )
    stats = _add_medians(row)
    if stats.get("requests_failed"):
        row["problems"].append(("FAIL", f"{label}: {stats['requests_failed']} requests failed"))
    wall = row["wall_s"]["median"] if row["wall_s"] else None
    row["pct_of_ceiling"] = 100.0 * ceiling_s / wall if ceiling_s and wall else None

    row["tokens_match"] = None
    if workload.greedy and reference is not None and reference.error is None:
        row["tokens_match"], found = check_runs(label, result, reference, dtype)
        row["problems"].extend(found)
    elif not workload.greedy:
        row["sample_check"] = _sample_check(label, result, row["problems"])
    return row


def _sample_check(label: str, result: EngineResult, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The sampled-workload checks of every run (logprob_check.py) folded into one summary; a failed
    run becomes a FAIL problem naming it, a missing check an ``unchecked`` marker."""
    checks = result.sample_checks
    if not checks:
        return None
    for i, check in enumerate(checks, start=1):
        if not check["ok"]:
            diff = check["max_raw_logprob_diff"]
            problems.append(
                (
                    "FAIL",
                    f"{label} (run {i}): sampled tokens do not fit the model's own forward: z = {check['z']:.1f}"
                    + (f", raw logprobs off by up to {diff:.2g}" if diff is not None else ""),
                )
            )
    diffs = [c["max_raw_logprob_diff"] for c in checks if c["max_raw_logprob_diff"] is not None]
    return {
        "runs": len(checks),
        "sequences": checks[0]["sequences"],
        "tokens": sum(c["tokens"] for c in checks),
        "max_abs_z": max(abs(c["z"]) for c in checks),
        "max_raw_logprob_diff": max(diffs) if diffs else None,
        "ok": all(c["ok"] for c in checks),
    }


def _run_entry(run: RunRecord, workload: Workload) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "wall_s": run.wall_s,
        "output_tokens": run.output_tokens,
        "output_tok_s": run.output_tokens / run.wall_s,
        "total_tok_s": (workload.prompt_tokens + run.output_tokens) / run.wall_s,
    }
    if run.ttft_s:
        entry["ttft_p50_s"] = _percentile(run.ttft_s, 0.50)
        entry["ttft_p99_s"] = _percentile(run.ttft_s, 0.99)
    if run.stats:
        entry["stats"] = run.stats
    if run.phase_s:
        entry["phase_s"] = run.phase_s
    return entry


def _add_medians(row: dict[str, Any]) -> dict[str, Any]:
    """Adds the spreads, TTFT medians and engine counters of ``row["runs"]``; returns the counters."""
    runs = row["runs"]
    for key in ("wall_s", "output_tok_s", "total_tok_s"):
        row[key] = _spread([r[key] for r in runs])
    for key in ("ttft_p50_s", "ttft_p99_s"):
        values = [r[key] for r in runs if key in r]
        row[key] = statistics.median(values) if values else None
    # Engine counters come from the run whose wall time is the median.
    median_run = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2] if runs else {}
    stats = median_run.get("stats") or {}
    for key in ("steps", "mean_batch_size", "prefix_cache_hit_rate", "preemptions"):
        row[key] = stats.get(key)
    return stats


def summarize(
    workloads: dict[str, Workload],
    results: dict[str, dict[str, EngineResult]],
    flops: dict[str, dict[str, float]],
    ceilings: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    null_model: list[dict[str, Any]] | None = None,
    profile: dict[str, Any] | None = None,
    cold_start: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (see ``benchmarks/README.md`` for the fields).

    ``cold_start`` maps a workload to ``{"folder": ..., "engines": {engine: ColdStartResult}}`` or to
    ``{"skipped": reason}``; it becomes that workload's ``cold_start`` section.
    """
    dtype = meta.get("dtype", "float32")
    report: dict[str, Any] = {"meta": meta, "workloads": {}, "problems": [], "unchecked": []}
    for name, wl in workloads.items():
        engines = results.get(name, {})
        ceiling = ceilings.get(name)
        ceiling_s = _ceiling_seconds(ceiling, flops[name], dtype) if ceiling and name in flops else None
        reference = engines.get(REFERENCE_ENGINE)
        rows = {e: summarize_engine(r, wl, reference, dtype, ceiling_s) for e, r in engines.items()}
        entry: dict[str, Any] = {
            **wl.summary(),
            "total_tokens": wl.total_tokens,
            "flops": flops.get(name),
            "matmul_ceiling": ceiling and {**ceiling, "ceiling_s": ceiling_s, "dtype": dtype},
            "engines": rows,
            "ratios": _ratios(rows),
            "correctness": _correctness(name, wl, rows, reference, meta, report),
        }
        for row in rows.values():
            for level, text in row.pop("problems"):
                report["problems"].append({"level": level, "message": text})
                row.setdefault("flags", []).append(level)
        if cold_start is not None and name in cold_start:
            entry["cold_start"] = _cold_section(name, wl, cold_start[name], dtype, reference, meta, report)
        report["workloads"][name] = entry
    if null_model is not None:
        report["null_model"] = null_model
    if profile is not None:
        report["profile"] = profile
    return report


def _correctness(
    name: str,
    wl: Workload,
    rows: dict[str, dict[str, Any]],
    reference: EngineResult | None,
    meta: dict[str, Any],
    report: dict[str, Any],
) -> dict[str, Any]:
    """What the workload was checked against, and whether it was; a check that could not run is a
    FAIL problem, or with ``--no-check`` (``meta["no_check"]``) an ``unchecked`` entry."""
    ran = [e for e, row in rows.items() if not row.get("error")]
    if wl.greedy:
        checked = reference is not None and reference.error is None
        why = f"{REFERENCE_ENGINE} was not run" if reference is None else f"{REFERENCE_ENGINE} failed"
    else:
        missing = [e for e in ran if rows[e].get("sample_check") is None]
        checked = not missing
        why = f"no plain-forward check of {', '.join(missing)}"
    correctness = {
        "reference": REFERENCE_ENGINE if wl.greedy else "plain forward (sample of sequences)",
        "checked": bool(checked and ran),
    }
    if ran and not checked:
        message = f"{name}: output NOT checked ({why})"
        correctness["note"] = f"not checked: {why}"
        if meta.get("no_check"):
            report["unchecked"].append(message)
        else:
            report["problems"].append(
                {"level": "FAIL", "message": message + "; --no-check reports it anyway"}
            )
    return correctness


def _ceiling_seconds(ceiling: dict[str, Any], flops: dict[str, float], dtype: str) -> float:
    """Seconds the workload's matmuls take at the measured ceiling rates."""
    rates = ceiling[dtype]
    return flops["prefill"] / (rates["prefill_gflops"] * 1e9) + flops["decode"] / (
        rates["decode_gflops"] * 1e9
    )


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Median output tok/s of each cbgen variant over each baseline that ran."""
    ratios = {}
    for variant in ("cbgen", "cbgen-compile"):
        cb = rows.get(variant)
        for base in BASELINES:
            other = rows.get(base)
            if cb and other and cb.get("output_tok_s") and other.get("output_tok_s"):
                ratios[f"{variant}/{base}"] = cb["output_tok_s"]["median"] / other["output_tok_s"]["median"]
    # Parity mode's price: its throughput over the default engine's, and the trainer forward's.
    par, cb = rows.get("cbgen-parity"), rows.get("cbgen")
    if par and cb and par.get("output_tok_s") and cb.get("output_tok_s"):
        ratios["cbgen-parity/cbgen"] = par["output_tok_s"]["median"] / cb["output_tok_s"]["median"]
    forward = (par or {}).get("settings", {}).get("trainer_forward")
    if forward:
        ratios["trainer-forward parity/default"] = forward["parity/default"]
    return ratios


def _cold_section(
    name: str,
    wl: Workload,
    plan: dict[str, Any],
    dtype: str,
    reference: EngineResult | None,
    meta: dict[str, Any],
    report: dict[str, Any],
) -> dict[str, Any]:
    """The workload's ``cold_start`` section; its problems go to the report's.  Greedy cold starts
    whose tokens no reference checked, and sampled ones without a plain-forward check, fail like the
    warm runs (``--no-check``: listed as unchecked)."""
    if plan.get("skipped"):
        return {"skipped": plan["skipped"], "engines": {}}
    section = summarize_cold_start(wl, plan["engines"], dtype, reference, plan.get("folder"))
    report["problems"].extend(section.pop("problems"))
    ran = any(r.get("total_s") is not None for r in section["engines"].values())
    if ran and not section["correctness"]["checked"]:
        why = f"no {REFERENCE_ENGINE} output" if wl.greedy else "no plain-forward check"
        message = f"{name} cold start: output NOT checked ({why})"
        if meta.get("no_check"):
            report["unchecked"].append(message)
        else:
            report["problems"].append(
                {"level": "FAIL", "message": message + "; --no-check reports it anyway"}
            )
    return section


def failed(report: dict[str, Any]) -> bool:
    """True if any check failed (mismatching greedy tokens in fp32, wrong token counts, engine errors)."""
    return any(p["level"] == "FAIL" for p in report["problems"])


def profile_breakdown(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, counts and per-step means of each phase, split into decode-only and prefill steps."""
    groups: dict[str, list[dict[str, Any]]] = {
        "all": steps,
        "decode_only": [s for s in steps if s["num_prefill_tokens"] == 0],
        "with_prefill": [s for s in steps if s["num_prefill_tokens"] > 0],
    }
    out: dict[str, Any] = {}
    for label, chosen in groups.items():
        phases: dict[str, Any] = {}
        for phase in ("schedule", "build", "forward", "sample", "update"):
            values = [s["times"][phase] for s in chosen if phase in s["times"]]
            total = sum(values)
            phases[phase] = {
                "total_s": total,
                "count": len(values),
                "mean_ms": 1e3 * total / len(values) if values else None,
            }
        out[label] = {
            "steps": len(chosen),
            "mean_seqs": statistics.mean(s["num_seqs"] for s in chosen) if chosen else None,
            "mean_tokens": statistics.mean(s["num_tokens"] for s in chosen) if chosen else None,
            "phases": phases,
        }
    return out


def write_json(report: dict[str, Any], path: Path) -> None:
    """Writes the report (atomically, so a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


__all__ = ["failed", "profile_breakdown", "summarize", "summarize_engine", "write_json"]
