"""Runs the engines of one workload round-robin, warm and cold, and logs progress to stderr."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from cbgen_bench.cold_start import COLD_ENGINES, ColdStartResult, run_cold_start
from cbgen_bench.engine_result import EngineResult, merge_results
from cbgen_bench.engine_settings import BenchOptions
from cbgen_bench.engines import run_engine, run_isolated
from cbgen_bench.workloads import Workload, model_path

_START = time.monotonic()


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the benchmark started."""
    print(f"[cbgen bench {time.monotonic() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _describe(result: EngineResult) -> str:
    if result.error:
        return f"ERROR {result.error}"
    walls = sorted(r.wall_s for r in result.runs)
    mid = walls[len(walls) // 2]
    tokens = result.runs[0].output_tokens if result.runs else 0
    return f"median {mid:.2f} s over {len(walls)} run(s), {tokens / mid:,.0f} output tok/s"


def run_rounds(
    name: str, wl: Workload, engines: list[str], model: Any, key: str, opts: BenchOptions, isolate: bool
) -> dict[str, EngineResult]:
    """Runs the engines round-robin, one repeat each per round, so that a change in machine load
    (other jobs on a shared box) hits every engine alike instead of whichever ran at the time.
    vLLM is the exception: its start-up takes a minute or more, so it runs all its repeats at once."""
    one = dataclasses.replace(opts, repeats=1)
    parts: dict[str, list[EngineResult]] = {e: [] for e in engines}
    for rnd in range(opts.repeats):
        for engine in engines:
            if parts[engine] and parts[engine][-1].error:
                continue  # a failing engine fails once, not once per round
            if engine == "vllm":
                if rnd > 0:
                    continue
                result = run_engine(engine, wl, model, opts, key)
            elif isolate:
                result = run_isolated(engine, name, key, one)
            else:
                result = run_engine(engine, wl, model, one, key)
            parts[engine].append(result)
            log(f"{name}/{engine} (round {rnd + 1}/{opts.repeats}): {_describe(result)}")
    merged = {e: merge_results(p) for e, p in parts.items() if p}
    for engine, result in merged.items():
        log(f"{name}/{engine}: {_describe(result)}")
    return merged


def _describe_cold(result: ColdStartResult) -> str:
    if result.error:
        return f"ERROR {result.error}"
    p = result.runs[-1].phases()
    split = (
        f"load {p['load_s']:.2f}, engine start {p['engine_start_s']:.2f}"
        if p["load_s"] is not None
        else f"load + engine start {p['load_engine_s']:.2f}"
    )
    return (
        f"total {p['total_s']:.2f} s (import {p['import_s']:.2f}, {split}, generate {p['generate_s']:.2f}; "
        f"exit took {p['exit_s']:.2f} more)"
    )


def cold_rounds(
    name: str, wl: Workload, engines: list[str], folder: str, opts: BenchOptions, repeats: int
) -> dict[str, ColdStartResult]:
    """Cold starts round-robin, one fresh process per engine per round, as :func:`run_rounds` does
    for the warm runs and for the same reason."""
    results: dict[str, ColdStartResult] = {}
    for rnd in range(repeats):
        for engine in engines:
            if engine in results and results[engine].error:
                continue
            results[engine] = run_cold_start(engine, folder, wl, opts, results.get(engine))
            log(f"{name}/{engine} cold start ({rnd + 1}/{repeats}): {_describe_cold(results[engine])}")
    return results


def cold_plan(
    name: str, wl: Workload, key: str, engines: list[str], opts: BenchOptions, repeats: int
) -> dict[str, Any]:
    """Runs the cold starts of one workload, or says why they cannot run."""
    chosen = [e for e in COLD_ENGINES if e in engines]
    folder = model_path(key)
    if folder is None:
        reason = f"model {key!r} exists only in memory; a cold start needs a model folder to load"
    elif not chosen:
        reason = f"none of its engines has a cold-start runner ({', '.join(COLD_ENGINES)})"
    else:
        return {"folder": folder, "engines": cold_rounds(name, wl, chosen, folder, opts, repeats)}
    log(f"{name}: cold start skipped ({reason})")
    return {"skipped": reason}


__all__ = ["cold_plan", "cold_rounds", "log", "run_rounds"]
