"""Turns raw engine results into the report: medians, ratios, correctness checks, JSON, PNG and markdown.

Throughput numbers only mean something if the output is right, so every greedy workload is checked
against ``hf-generate`` token for token, and every engine must produce exactly the workload's number of
tokens.  A failed check becomes a ``problems`` entry, a loud banner and a ``FAIL`` cell in the table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from cbgen.bench.cold_start import ColdStartResult, marks_ordered, median_phases
from cbgen.bench.engines import BASELINES, REFERENCE_ENGINE, EngineResult
from cbgen.bench.workloads import Workload

ENGINE_COLORS = {
    "cbgen": "#1f77b4",
    "cbgen-noshare": "#aec7e8",
    "cbgen-compile": "#17becf",
    "hf-generate": "#ff7f0e",
    "hf-cb": "#2ca02c",
    "vllm": "#9467bd",
}


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


def tokens_match(tokens: list | None, reference: list | None) -> float | None:
    """Fraction of sequences (request x sample) identical to the reference's; None if either is missing."""
    if tokens is None or reference is None:
        return None
    pairs = [(a, b) for ra, rb in zip(tokens, reference) for a, b in zip(ra, rb)]
    expected = sum(len(r) for r in reference)
    if not pairs or len(pairs) != expected or len(tokens) != len(reference):
        return 0.0
    return sum(a == b for a, b in pairs) / len(pairs)


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
    if result.error:
        row["problems"].append(("FAIL", f"{workload.name}/{result.engine}: {result.error}"))
        return row
    for run in result.runs:
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
        row["runs"].append(entry)
        if run.output_tokens != workload.output_tokens:
            row["problems"].append(
                (
                    "FAIL",
                    f"{workload.name}/{result.engine}: produced {run.output_tokens} tokens, "
                    f"expected {workload.output_tokens}",
                )
            )
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
    if stats.get("requests_failed"):
        row["problems"].append(
            ("FAIL", f"{workload.name}/{result.engine}: {stats['requests_failed']} requests failed")
        )
    wall = row["wall_s"]["median"] if row["wall_s"] else None
    row["pct_of_ceiling"] = 100.0 * ceiling_s / wall if ceiling_s and wall else None

    row["tokens_match"] = None
    if workload.greedy and reference is not None and reference.error is None and result is not reference:
        row["tokens_match"], found = _check_tokens(
            f"{workload.name}/{result.engine}", result.tokens, reference.tokens, dtype
        )
        row["problems"].extend(found)
    elif result is reference and workload.greedy:
        row["tokens_match"] = "reference"
    return row


def _check_tokens(
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


def summarize_cold_start(
    workload: Workload,
    cold: dict[str, ColdStartResult],
    dtype: str,
    warm_reference: EngineResult | None = None,
    folder: str | None = None,
) -> dict[str, Any]:
    """The ``cold_start`` section of one workload: per engine the median seconds of each phase
    (:data:`cbgen.bench.cold_start.PHASES`), the runs, token checks and ``cbgen_speedup`` (the engine's
    median total over cbgen's).  Problems (``{"level", "message"}``) are left under the ``problems``
    key for :func:`summarize`, and their levels under each row's ``flags``.

    Greedy tokens are checked against the cold ``hf-generate`` run, or the warm one if the cold one
    did not run, so that no cold-start number comes from wrong output.
    """
    name = workload.name
    problems: list[dict[str, str]] = []

    def flag(row: dict[str, Any], level: str, message: str) -> None:
        problems.append({"level": level, "message": message})
        row.setdefault("flags", []).append(level)

    ref_engine = cold.get(REFERENCE_ENGINE)
    reference, ref_label = None, None
    if ref_engine is not None and ref_engine.error is None and ref_engine.tokens is not None:
        reference, ref_label = ref_engine.tokens, f"{REFERENCE_ENGINE} (cold)"
    elif warm_reference is not None and warm_reference.error is None and warm_reference.tokens is not None:
        reference, ref_label = warm_reference.tokens, f"{REFERENCE_ENGINE} (warm run)"
    rows: dict[str, dict[str, Any]] = {}
    for engine, result in cold.items():
        row: dict[str, Any] = {
            "engine": engine,
            "error": result.error,
            "repeats": len(result.runs),
            "settings": result.settings,
            "notes": list(result.notes),
            "runs": [],
        }
        rows[engine] = row
        label = f"{name}/{engine} cold start"
        if result.error:
            flag(row, "FAIL", f"{label}: {result.error}")
            if not result.runs:
                continue
        for run in result.runs:
            entry = {
                "spawn": run.spawn,
                "marks": run.marks,
                "exited": run.exited,
                "output_tokens": run.output_tokens,
                "peak_rss_bytes": run.peak_rss_bytes,
                **run.phases(),
            }
            row["runs"].append(entry)
            if run.output_tokens != workload.output_tokens:
                flag(
                    row,
                    "FAIL",
                    f"{label}: produced {run.output_tokens} tokens, expected {workload.output_tokens}",
                )
            if not marks_ordered(run.spawn, run.marks):
                # A clock step (NTP) between two marks: the phases of this run are meaningless.
                flag(row, "WARN", f"{label}: timestamps out of order {run.marks}")
        row.update(median_phases(result.runs))
        totals = [r["total_s"] for r in row["runs"] if r["total_s"] is not None]
        row["total_s_min"] = min(totals) if totals else None
        row["total_s_max"] = max(totals) if totals else None
        row["output_tokens"] = result.runs[-1].output_tokens if result.runs else None
        peaks = [r.peak_rss_bytes for r in result.runs if r.peak_rss_bytes]
        row["peak_rss_bytes"] = max(peaks) if peaks else None
        row["tokens_match"] = None
        if workload.greedy and reference is not None:
            if result is ref_engine:
                row["tokens_match"] = "reference"
            else:
                row["tokens_match"], found = _check_tokens(label, result.tokens, reference, dtype)
                for level, message in found:
                    flag(row, level, message)
    cb_total = rows.get("cbgen", {}).get("total_s")
    for engine, row in rows.items():
        total = row.get("total_s")
        row["cbgen_speedup"] = total / cb_total if engine != "cbgen" and total and cb_total else None
    return {
        "folder": folder,
        "engines": rows,
        "correctness": {
            "reference": ref_label if workload.greedy else None,
            "checked": bool(workload.greedy and reference is not None),
        },
        "problems": problems,
    }


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
    report: dict[str, Any] = {"meta": meta, "workloads": {}, "problems": []}
    for name, wl in workloads.items():
        engines = results.get(name, {})
        ceiling = ceilings.get(name)
        ceiling_s = None
        if ceiling and name in flops:
            rates = ceiling[dtype]
            ceiling_s = flops[name]["prefill"] / (rates["prefill_gflops"] * 1e9) + flops[name]["decode"] / (
                rates["decode_gflops"] * 1e9
            )
        reference = engines.get(REFERENCE_ENGINE)
        rows = {e: summarize_engine(r, wl, reference, dtype, ceiling_s) for e, r in engines.items()}
        entry: dict[str, Any] = {
            **wl.summary(),
            "total_tokens": wl.total_tokens,
            "flops": flops.get(name),
            "matmul_ceiling": ceiling and {**ceiling, "ceiling_s": ceiling_s, "dtype": dtype},
            "engines": rows,
            "ratios": {},
            "correctness": {
                "reference": REFERENCE_ENGINE if wl.greedy else None,
                "checked": bool(wl.greedy and reference is not None and reference.error is None),
            },
        }
        for variant in ("cbgen", "cbgen-compile"):
            cb = rows.get(variant)
            for base in BASELINES:
                other = rows.get(base)
                if cb and other and cb.get("output_tok_s") and other.get("output_tok_s"):
                    entry["ratios"][f"{variant}/{base}"] = (
                        cb["output_tok_s"]["median"] / other["output_tok_s"]["median"]
                    )
        if wl.greedy and "cbgen" in rows and reference is None:
            entry["correctness"]["note"] = f"not checked: {REFERENCE_ENGINE} was not run"
        for row in rows.values():
            for level, text in row.pop("problems"):
                report["problems"].append({"level": level, "message": text})
                row.setdefault("flags", []).append(level)
        if cold_start is not None and name in cold_start:
            plan = cold_start[name]
            if plan.get("skipped"):
                entry["cold_start"] = {"skipped": plan["skipped"], "engines": {}}
            else:
                section = summarize_cold_start(wl, plan["engines"], dtype, reference, plan.get("folder"))
                report["problems"].extend(section.pop("problems"))
                entry["cold_start"] = section
        report["workloads"][name] = entry
    if null_model is not None:
        report["null_model"] = null_model
    if profile is not None:
        report["profile"] = profile
    return report


def failed(report: dict[str, Any]) -> bool:
    """True if any check failed (mismatching greedy tokens in fp32, wrong token counts, engine errors)."""
    return any(p["level"] == "FAIL" for p in report["problems"])


# --------------------------------------------------------------------------- profile


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


# --------------------------------------------------------------------------- output files


def write_json(report: dict[str, Any], path: Path) -> None:
    """Writes the report (atomically, so a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def plot(report: dict[str, Any], path: Path) -> None:
    """Bar chart of median output tokens/s per engine, one panel per workload, min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, w in report["workloads"].items() if w["engines"]]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        wl = report["workloads"][name]
        rows = [r for r in wl["engines"].values() if r.get("output_tok_s")]
        labels = [r["engine"] for r in rows]
        med = [r["output_tok_s"]["median"] for r in rows]
        lo = [m - r["output_tok_s"]["min"] for m, r in zip(med, rows)]
        hi = [r["output_tok_s"]["max"] - m for m, r in zip(med, rows)]
        colors = [ENGINE_COLORS.get(e, "#7f7f7f") for e in labels]
        bars = ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color=colors)
        for bar, row in zip(bars, rows):
            if "FAIL" in row.get("flags", []):
                bar.set_hatch("xx")
                bar.set_edgecolor("red")
                ax.annotate(
                    "WRONG OUTPUT",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    color="red",
                    fontsize=8,
                    fontweight="bold",
                )
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
        ax.set_title(f"{name} ({wl['model']})", fontsize=10)
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.grid(axis="y", alpha=0.3)
    meta = report["meta"]
    fig.suptitle(
        f"cbgen bench: {meta.get('device')}, {meta.get('dtype')}, {meta.get('threads')} threads, "
        f"{meta.get('repeats')} repeats",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value: Any, spec: str = ".1f", none: str = "–") -> str:
    if value is None:
        return none
    return format(value, spec)


def _mem(row: dict[str, Any]) -> str:
    b = row.get("peak_memory_bytes")
    if not b:
        return "–"
    tag = "" if row.get("memory_kind") == "cuda" or row.get("isolated") else "*"
    return f"{b / 2**20:,.0f} MiB{tag}"


def _match(row: dict[str, Any]) -> str:
    m = row.get("tokens_match")
    if m == "reference":
        return "ref"
    if m is None:
        return "–"
    if m < 1.0:
        return f"**{'FAIL' if 'FAIL' in row.get('flags', []) else 'WARN'} {m:.0%}**"
    return "100%"


def cold_start_markdown(report: dict[str, Any]) -> list[str]:
    """The cold-start table and its notes as markdown lines; empty if no workload has a section."""
    sections = {n: w["cold_start"] for n, w in report["workloads"].items() if "cold_start" in w}
    if not sections:
        return []
    rows, notes = [], []
    combined = False
    for name, section in sections.items():
        if section.get("skipped"):
            notes.append(f"- cold start skipped for {name}: {section['skipped']}")
            continue
        ran = any(not r.get("error") for r in section["engines"].values())
        if ran and report["workloads"][name].get("greedy") and not section["correctness"]["checked"]:
            notes.append(f"- cold start {name}: tokens NOT checked (no {REFERENCE_ENGINE} output)")
        for engine, row in section["engines"].items():
            if row.get("total_s") is None:
                rows.append(f"| {name} | {engine} | **ERROR** {row.get('error')} |" + " |" * 6)
                continue
            if row.get("load_s") is None:
                # Loaded and started in one call (vLLM's LLM()): one number across both columns.
                combined = True
                load, start = "–", f"{row['load_engine_s']:.2f} †"
            else:
                load, start = f"{row['load_s']:.2f}", f"{row['engine_start_s']:.2f}"
            total = f"{row['total_s']:.2f}"
            if row.get("repeats", 1) > 1:
                total += f" ({row['total_s_min']:.2f}–{row['total_s_max']:.2f})"
            rows.append(
                f"| {name} | {engine} | {row['import_s']:.2f} | {load} | {start} | "
                f"{row['generate_s']:.2f} | **{total}** | {_match(row)} | "
                f"{_fmt(row.get('cbgen_speedup'), '.2f')} |"
            )
    if combined:
        notes.insert(
            0, "- † load and engine start as one number: the engine loads the weights inside `LLM()` (vLLM)"
        )
    repeats = report["meta"].get("cold_repeats") or 1
    lines = ["### Cold start: process start → all outputs", ""]
    if rows:
        lines += [
            f"One fresh process per engine{'' if repeats == 1 else f' and repeat (medians of {repeats})'}: "
            "import, load the model from its folder, build the engine, generate the whole workload once "
            "with no warm-up. Seconds; *import* counts from the spawn, so it holds Python's start-up; "
            "*total* is spawn → last output (process exit left out); *cbgen ×* is the engine's total "
            "over cbgen's.",
            "",
            "| workload | engine | import s | load s | engine start s | generate s | total s | tokens match "
            "| cbgen × |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    if notes:
        lines += [*notes, ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The human-readable report; the results table comes last, the cold-start table before it."""
    meta = report["meta"]
    lines = [
        f"## cbgen bench ({meta.get('started')})",
        "",
        f"device {meta.get('device')} · dtype {meta.get('dtype')} · {meta.get('threads')} torch threads · "
        f"{meta.get('repeats')} repeats (medians) · torch {meta.get('torch')} · transformers "
        f"{meta.get('transformers')}{' · TINY workloads' if meta.get('tiny') else ''}",
        "",
    ]
    env = " ".join(f"{k}={v}" for k, v in (meta.get("env") or {}).items())
    load = [meta.get("loadavg_start"), meta.get("loadavg_end")]
    if env or any(x is not None for x in load):
        lines += [
            f"load average {_fmt(load[0], '.1f')} at start, {_fmt(load[1], '.1f')} at end on "
            f"{meta.get('cpu_count')} CPUs{' · ' + env if env else ''}",
            "",
        ]
        busy = [x for x in load if x is not None and meta.get("cpu_count") and x > 0.5 * meta["cpu_count"]]
        if busy:
            lines += [
                "> **Note**: the machine was busy with other work; timings are noisy and engines that "
                "run torch on the main thread suffer most (see benchmarks/README.md).",
                "",
            ]
    problems = report["problems"]
    if problems:
        fails = [p for p in problems if p["level"] == "FAIL"]
        if fails:
            lines += [
                "> **!!! CORRECTNESS CHECK FAILED: the numbers below come from wrong output and must "
                "not be used !!!**",
                ">",
            ]
        lines += [f"> **{p['level']}**: {p['message']}" for p in problems] + [""]

    null_rows = report.get("null_model")
    if null_rows:
        lines += [
            "### Engine overhead with a null model (stub logits; median ms per decode step)",
            "",
            "| running | mode | schedule | build | update | **overhead** (s+b+u) | sample | stub forward | step | tok/s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in null_rows:
            lines.append(
                f"| {r['running']} | {r['mode']} | {r['schedule_ms']:.3f} | {r['build_ms']:.3f} | "
                f"{r['update_ms']:.3f} | **{r['overhead_ms']:.3f}** | {r['sample_ms']:.3f} | "
                f"{r['forward_ms']:.3f} | {r['step_ms']:.3f} | {_fmt(r['tokens_per_s'], ',.0f')} |"
            )
        lines.append("")

    prof = report.get("profile")
    if prof:
        lines += [
            "### Per-step profile of cbgen (last run; mean ms per step, total s, count)",
            "",
            "| workload | steps | mean seqs | schedule | build | forward | sample | update |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, groups in prof.items():
            for label, g in groups.items():
                cells = [
                    f"{_fmt(p['mean_ms'], '.2f')} ({p['total_s']:.2f} s, {p['count']})"
                    for p in g["phases"].values()
                ]
                lines.append(
                    f"| {name} | {label}: {g['steps']} | {_fmt(g['mean_seqs'], '.1f')} | "
                    + " | ".join(cells)
                    + " |"
                )
        lines.append("")

    notes = []
    for name, wl in report["workloads"].items():
        desc = (
            f"- **{name}** ({wl['model']}): {wl['description']}; {wl['prompt_tokens']:,} prompt + "
            f"{wl['output_tokens']:,} output tokens"
        )
        ratios = ", ".join(f"{k} = {v:.2f}x" for k, v in wl["ratios"].items())
        if ratios:
            desc += f"; output tok/s {ratios}"
        ceiling = wl.get("matmul_ceiling")
        if ceiling and ceiling.get("ceiling_s"):
            rates = ceiling[ceiling["dtype"]]
            desc += (
                f"; matmul ceiling {ceiling['ceiling_s']:.2f} s ({ceiling['dtype']}: "
                f"{rates['decode_gflops']:.0f} GFLOP/s decode @{ceiling['decode_rows']} rows, "
                f"{rates['prefill_gflops']:.0f} prefill @{ceiling['prefill_rows']})"
            )
        if not wl["correctness"]["checked"] and wl["greedy"]:
            desc += f"; tokens NOT checked ({REFERENCE_ENGINE} not run)"
        notes.append(desc)
    notes += [f"- skipped {s['workload']}/{s['engine']}: {s['reason']}" for s in report.get("skipped", [])]
    if notes:
        lines += [*notes, ""]
    if any(not r.get("isolated") for wl in report["workloads"].values() for r in wl["engines"].values()):
        lines += [
            "\\* peak RSS of the shared benchmark process (run without isolation), not of the engine alone",
            "",
        ]

    cold = cold_start_markdown(report)
    if cold:
        lines += [*cold, "### Throughput after warm-up (generate only)", ""]
    lines += [
        "| workload | engine | wall s | output tok/s (min–max) | total tok/s | peak mem | steps | mean batch | "
        "prefix hit | preempt | TTFT p50 / p99 ms | % matmul ceiling | tokens match | cbgen × |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, wl in report["workloads"].items():
        cb = wl["engines"].get("cbgen")
        for engine, row in wl["engines"].items():
            if row.get("error"):
                lines.append(f"| {name} | {engine} | **ERROR** {row['error']} |" + " |" * 11)
                continue
            ots = row["output_tok_s"]
            ttft = (
                f"{1e3 * row['ttft_p50_s']:,.0f} / {1e3 * row['ttft_p99_s']:,.0f}"
                if row.get("ttft_p50_s") is not None
                else "–"
            )
            speedup = "–"
            if engine != "cbgen" and cb and cb.get("output_tok_s"):
                speedup = f"{cb['output_tok_s']['median'] / ots['median']:.2f}"
            hit = row.get("prefix_cache_hit_rate")
            lines.append(
                f"| {name} | {engine} | {row['wall_s']['median']:.2f} | "
                f"{ots['median']:,.0f} ({ots['min']:,.0f}–{ots['max']:,.0f}) | "
                f"{row['total_tok_s']['median']:,.0f} | {_mem(row)} | {_fmt(row.get('steps'), 'd')} | "
                f"{_fmt(row.get('mean_batch_size'), '.1f')} | {_fmt(None if hit is None else 100 * hit, '.0f')}"
                f"{'%' if hit is not None else ''} | {_fmt(row.get('preemptions'), 'd')} | {ttft} | "
                f"{_fmt(row.get('pct_of_ceiling'), '.0f')}{'%' if row.get('pct_of_ceiling') is not None else ''} | "
                f"{_match(row)} | {speedup} |"
            )
    return "\n".join(lines) + "\n"
