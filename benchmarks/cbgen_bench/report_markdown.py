"""The human-readable report: the summary dict of :func:`cbgen_bench.report.summarize` as markdown.

Sections, in order: header and machine load, problems (a loud banner if a check failed), the null
model, the per-step profile, one note per workload, the cold-start table, and last the throughput
table (readers and tests look for it at the end).
"""

from __future__ import annotations

from typing import Any

from cbgen_bench.engine_settings import REFERENCE_ENGINE
from cbgen_bench.long_context import long_markdown


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
    sampled = row.get("sample_check")
    if sampled is not None:
        return (
            f"ok (z {sampled['max_abs_z']:.1f})"
            if sampled["ok"]
            else f"**FAIL** (z {sampled['max_abs_z']:.1f})"
        )
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
            line, one_number = _cold_row(name, engine, row)
            rows.append(line)
            combined |= one_number
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


def _cold_row(name: str, engine: str, row: dict[str, Any]) -> tuple[str, bool]:
    """One engine's cold-start table line, and whether it shows load and engine start as one number."""
    if row.get("total_s") is None:
        return f"| {name} | {engine} | **ERROR** {row.get('error')} |" + " |" * 6, False
    combined = row.get("load_s") is None
    if combined:
        # Loaded and started in one call (vLLM's LLM()): one number across both columns.
        load, start = "–", f"{row['load_engine_s']:.2f} †"
    else:
        load, start = f"{row['load_s']:.2f}", f"{row['engine_start_s']:.2f}"
    total = f"{row['total_s']:.2f}"
    if row.get("repeats", 1) > 1:
        total += f" ({row['total_s_min']:.2f}–{row['total_s_max']:.2f})"
    line = (
        f"| {name} | {engine} | {row['import_s']:.2f} | {load} | {start} | "
        f"{row['generate_s']:.2f} | **{total}** | {_match(row)} | "
        f"{_fmt(row.get('cbgen_speedup'), '.2f')} |"
    )
    return line, combined


def markdown(report: dict[str, Any]) -> str:
    """The human-readable report; the results table comes last, the cold-start table before it."""
    lines = _header(report["meta"])
    lines += _unchecked(report.get("unchecked"))
    lines += _problems(report["problems"])
    lines += _null_model_table(report.get("null_model"))
    lines += _profile_table(report.get("profile"))
    lines += _workload_notes(report)
    lines += long_markdown(report.get("long"))
    cold = cold_start_markdown(report)
    if cold:
        lines += [*cold, "### Throughput after warm-up (generate only)", ""]
    lines += _results_table(report)
    return "\n".join(lines) + "\n"


def _header(meta: dict[str, Any]) -> list[str]:
    """Title, versions and settings, and the machine load (with a warning if it was busy)."""
    lines = [
        f"## cbgen bench ({meta.get('started')})",
        "",
        f"CPU {meta.get('cpu')} ({', '.join(meta.get('cpu_features') or ['no AVX2/AVX-512/AMX'])}) · "
        f"{meta.get('cpu_count')} cores",
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
    return lines


def _unchecked(unchecked: list[str] | None) -> list[str]:
    """The ``--no-check`` banner: which outputs no check covered."""
    if not unchecked:
        return []
    lines = ["> **NOT CHECKED (--no-check): the numbers below include output that nothing verified**", ">"]
    return lines + [f"> {message}" for message in unchecked] + [""]


def _problems(problems: list[dict[str, str]]) -> list[str]:
    if not problems:
        return []
    lines = []
    if any(p["level"] == "FAIL" for p in problems):
        lines += [
            "> **!!! CORRECTNESS CHECK FAILED: the numbers below come from wrong output and must "
            "not be used !!!**",
            ">",
        ]
    return lines + [f"> **{p['level']}**: {p['message']}" for p in problems] + [""]


def _null_model_table(null_rows: list[dict[str, Any]] | None) -> list[str]:
    if not null_rows:
        return []
    lines = [
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
    return [*lines, ""]


def _profile_table(prof: dict[str, Any] | None) -> list[str]:
    if not prof:
        return []
    lines = [
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
    return [*lines, ""]


def _workload_notes(report: dict[str, Any]) -> list[str]:
    """One line per workload (size, ratios, matmul ceiling), skipped engines, the RSS footnote."""
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
                f"{rates['decode_gflops']:.0f} GFLOP/s decode @{ceiling['decode_rows']} rows "
                f"({rates.get('decode_gemm', 'F.linear')}), {rates['prefill_gflops']:.0f} prefill "
                f"@{ceiling['prefill_rows']} ({rates.get('prefill_gemm', 'F.linear')}); cold weights, "
                "best of every GEMM the engine can choose)"
            )
        if "note" in wl["correctness"]:
            desc += f"; output {wl['correctness']['note']}"
        notes.append(desc)
        above = {
            e: r["pct_of_ceiling"] for e, r in wl["engines"].items() if (r.get("pct_of_ceiling") or 0) > 100
        }
        if above:
            reads = ", ".join(f"{e} {v:.0f}%" for e, v in above.items())
            notes.append(
                f"- **{name}: the matmul ceiling is wrong**: {reads} of it; a GEMM faster than every one "
                "timed exists here (or the machine sped up between the ceiling's timings and the runs)"
            )
    notes += [f"- skipped {s['workload']}/{s['engine']}: {s['reason']}" for s in report.get("skipped", [])]
    lines = [*notes, ""] if notes else []
    if any(not r.get("isolated") for wl in report["workloads"].values() for r in wl["engines"].values()):
        lines += [
            "\\* peak RSS of the shared benchmark process (run without isolation), not of the engine alone",
            "",
        ]
    return lines


def _results_table(report: dict[str, Any]) -> list[str]:
    # Workloads that ran but whose output nothing checked (only possible with --no-check).
    unchecked = [n for n, wl in report["workloads"].items() if "note" in wl.get("correctness", {})]
    check = "output checked" if not unchecked else f"output checked (**NOT CHECKED: {', '.join(unchecked)}**)"
    lines = [
        "| workload | engine | wall s | output tok/s (min–max) | total tok/s | peak mem | steps | mean batch | "
        f"prefix hit | preempt | TTFT p50 / p99 ms | % matmul ceiling | {check} | cbgen × |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, wl in report["workloads"].items():
        cb = wl["engines"].get("cbgen")
        for engine, row in wl["engines"].items():
            if row.get("error"):
                lines.append(f"| {name} | {engine} | **ERROR** {row['error']} |" + " |" * 11)
            else:
                lines.append(_results_row(name, engine, row, cb, name in unchecked))
    return lines


def _results_row(
    name: str, engine: str, row: dict[str, Any], cb: dict[str, Any] | None, unchecked: bool = False
) -> str:
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
    return (
        f"| {name} | {engine} | {row['wall_s']['median']:.2f} | "
        f"{ots['median']:,.0f} ({ots['min']:,.0f}–{ots['max']:,.0f}) | "
        f"{row['total_tok_s']['median']:,.0f} | {_mem(row)} | {_fmt(row.get('steps'), 'd')} | "
        f"{_fmt(row.get('mean_batch_size'), '.1f')} | {_fmt(None if hit is None else 100 * hit, '.0f')}"
        f"{'%' if hit is not None else ''} | {_fmt(row.get('preemptions'), 'd')} | {ttft} | "
        f"{_fmt(row.get('pct_of_ceiling'), '.0f')}{'%' if row.get('pct_of_ceiling') is not None else ''} | "
        f"{'NOT CHECKED' if unchecked else _match(row)} | {speedup} |"
    )


__all__ = ["cold_start_markdown", "markdown"]
