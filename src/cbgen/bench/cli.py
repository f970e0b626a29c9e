"""``cbgen bench``: runs the built-in workloads on cbgen and its baselines and writes the report.

Examples::

    cbgen bench                                   # default suite: chat + overhead vs hf-generate, hf-cb
    cbgen bench --suite full --repeats 5          # chat, overhead, grpo (+ cbgen-noshare), mixed
    cbgen bench --workloads chat --vllm-python ~/venvs/vllmcpu/bin/python
    cbgen bench --null-model                      # engine overhead only (stub model)
    cbgen bench --tiny --repeats 1 --no-isolate   # seconds-long smoke run
    cbgen bench --workloads chat --cold-start     # + process start -> all outputs, per engine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from cbgen.bench.cold_start import COLD_ENGINES, ColdStartResult, run_cold_start
from cbgen.bench.engines import (
    ENGINE_NAMES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    BenchOptions,
    EngineResult,
    best_ceiling,
    matmul_ceiling,
    merge_results,
    run_engine,
    run_isolated,
    vllm_unsupported_reason,
)
from cbgen.bench.report import failed, markdown, plot, profile_breakdown, summarize, write_json
from cbgen.bench.workloads import (
    DEFAULT_MODELS,
    DEFAULT_SUITE,
    FULL_SUITE,
    WORKLOAD_NAMES,
    Workload,
    build_workload,
    load_bench_model,
    model_dims,
    model_path,
    vocab_size_of,
    workload_flops,
)

SUITES: dict[str, tuple[str, ...]] = {"default": DEFAULT_SUITE, "full": FULL_SUITE}
# Engines each workload runs when --engines is not given; vllm joins when --vllm-python is.
DEFAULT_ENGINES: dict[str, tuple[str, ...]] = {
    "chat": ("cbgen", "hf-generate", "hf-cb"),
    "overhead": ("cbgen", "hf-generate", "hf-cb"),
    "grpo": ("cbgen", "cbgen-noshare", "hf-generate", "hf-cb"),
    "mixed": ("cbgen", "hf-generate", "hf-cb"),
}
EXIT_CHECK_FAILED = 3


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The ``cbgen bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="cbgen bench",
        description="Benchmark cbgen against transformers (and optionally vLLM) on built-in workloads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1],
    )
    p.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default=None,
        help="default: chat + overhead; full: every workload (default: default)",
    )
    p.add_argument(
        "--workloads",
        type=_csv,
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (overrides --suite)",
    )
    p.add_argument(
        "--engines",
        type=_csv,
        default=None,
        help=f"comma-separated subset of {','.join(ENGINE_NAMES)} (default: per workload)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; medians are reported (3)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model dtype; token-for-token checks are strict only in float32 (float32)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="hf-generate static batch size; 0 = all prompts in one batch (0)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results"),
        help="directory for the JSON, PNG and markdown files (benchmarks/results)",
    )
    p.add_argument("--tiny", action="store_true", help="shrink every workload to a few prompts and tokens")
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of a virtualenv with vLLM; adds the vllm engine (see benchmarks/README.md)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="record cbgen's per-step phase times (schedule/build/forward/sample/update)",
    )
    p.add_argument(
        "--null-model",
        action="store_true",
        help="measure engine overhead with a stub model at 1/16/64/256 running requests; "
        "alone (without --suite/--workloads) it runs nothing else",
    )
    p.add_argument(
        "--model",
        default=None,
        help="run every workload on this model: tiny, smollm2 or a local HF folder "
        "(default: each workload's own; chat/grpo use smollm2, overhead/mixed tiny)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="run engines in this process (faster start; peak RSS is then the process's)",
    )
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="also time each workload end to end: a fresh process per engine (cbgen, hf-generate, "
        "vllm) imports, loads the model folder, builds the engine and generates once, no warm-up",
    )
    p.add_argument(
        "--cold-repeats",
        type=int,
        default=1,
        metavar="N",
        help="fresh processes per engine for --cold-start; medians are reported (1)",
    )
    return p


def _plan(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    if args.workloads is not None:
        names = args.workloads
    elif args.suite is None and args.null_model:
        names = []
    else:
        names = list(SUITES[args.suite or "default"])
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown:
        raise SystemExit(
            f"cbgen bench: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    if args.engines is not None:
        bad = [e for e in args.engines if e not in ENGINE_NAMES]
        if bad:
            raise SystemExit(
                f"cbgen bench: unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINE_NAMES)}"
            )
        if "vllm" in args.engines and not args.vllm_python:
            raise SystemExit("cbgen bench: the vllm engine needs --vllm-python PATH")
    plan = []
    for name in names:
        engines = list(args.engines) if args.engines is not None else list(DEFAULT_ENGINES[name])
        if args.engines is None and args.vllm_python:
            engines.append("vllm")
        plan.append((name, engines))
    return plan


# Settings that change how torch's thread pool behaves; recorded because they move results a lot.
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "LD_PRELOAD")


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch
    import transformers

    from cbgen.utils import resolve_device

    device = resolve_device(args.device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": argv,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "tiny": args.tiny,
        "isolated": not args.no_isolate,
        "cold_start": args.cold_start,
        "cold_repeats": args.cold_repeats if args.cold_start else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "loadavg_start": _loadavg(),
    }


_START = time.monotonic()


def _log(msg: str) -> None:
    print(f"[cbgen bench {time.monotonic() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _describe(result: EngineResult) -> str:
    if result.error:
        return f"ERROR {result.error}"
    walls = sorted(r.wall_s for r in result.runs)
    mid = walls[len(walls) // 2]
    tokens = result.runs[0].output_tokens if result.runs else 0
    return f"median {mid:.2f} s over {len(walls)} run(s), {tokens / mid:,.0f} output tok/s"


def _run_rounds(
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
            _log(f"{name}/{engine} (round {rnd + 1}/{opts.repeats}): {_describe(result)}")
    merged = {e: merge_results(p) for e, p in parts.items() if p}
    for engine, result in merged.items():
        _log(f"{name}/{engine}: {_describe(result)}")
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


def _cold_rounds(
    name: str, wl: Workload, engines: list[str], folder: str, opts: BenchOptions, repeats: int
) -> dict[str, ColdStartResult]:
    """Cold starts round-robin, one fresh process per engine per round, as :func:`_run_rounds` does
    for the warm runs and for the same reason."""
    results: dict[str, ColdStartResult] = {}
    for rnd in range(repeats):
        for engine in engines:
            if engine in results and results[engine].error:
                continue
            results[engine] = run_cold_start(engine, folder, wl, opts, results.get(engine))
            _log(f"{name}/{engine} cold start ({rnd + 1}/{repeats}): {_describe_cold(results[engine])}")
    return results


def _cold_plan(
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
        return {"folder": folder, "engines": _cold_rounds(name, wl, chosen, folder, opts, repeats)}
    _log(f"{name}: cold start skipped ({reason})")
    return {"skipped": reason}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cbgen bench``; exits with status 3 if a correctness check failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("cbgen bench: --repeats must be >= 1")
    if args.cold_repeats < 1:
        raise SystemExit("cbgen bench: --cold-repeats must be >= 1")
    plan = _plan(args)
    opts = BenchOptions(
        repeats=args.repeats,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        profile=args.profile,
        tiny=args.tiny,
        vllm_python=args.vllm_python,
        model=args.model,
    )
    meta = _meta(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    models: dict[str, tuple[Any, Any]] = {}

    def model_for(key: str) -> tuple[Any, Any]:
        if key not in models:
            _log(f"loading model {key} ({args.dtype})")
            models[key] = load_bench_model(key, args.dtype, args.device)
        return models[key]

    workloads: dict[str, Workload] = {}
    results: dict[str, dict[str, EngineResult]] = {}
    flops: dict[str, dict[str, float]] = {}
    ceilings: dict[str, dict[str, Any]] = {}
    skipped: list[dict[str, str]] = []
    profile: dict[str, Any] = {}
    step_records: dict[str, Any] = {}
    cold: dict[str, dict[str, Any]] = {}
    for name, engines in plan:
        key = args.model or DEFAULT_MODELS[name]
        model, tokenizer = model_for(key)
        wl = build_workload(
            name, tiny=args.tiny, model=key, vocab_size=vocab_size_of(model), tokenizer=tokenizer
        )
        workloads[name] = wl
        _log(
            f"{name}: {wl.description} on {key} ({wl.prompt_tokens:,} prompt + {wl.output_tokens:,} output tokens)"
        )
        runnable = []
        for engine in engines:
            reason = vllm_unsupported_reason(model) if engine == "vllm" else None
            if reason:
                skipped.append({"workload": name, "engine": engine, "reason": reason})
                _log(f"{name}/{engine}: skipped ({reason})")
            else:
                runnable.append(engine)
        dims = model_dims(model)
        flops[name] = workload_flops(wl, dims)
        rows = {
            "decode_rows": min(wl.num_sequences, MAX_NUM_SEQS),
            "prefill_rows": min(wl.prompt_tokens, MAX_NUM_BATCHED_TOKENS),
        }
        budget = 0.03 if args.tiny else 0.3
        # Timed before and after the engines; the better of the two is the ceiling, so a burst of
        # load from other jobs during one measurement does not lower it.
        _log(f"{name}: timing the matmul ceiling")
        before = matmul_ceiling(dims, **rows, device=args.device, budget_s=budget)
        results[name] = _run_rounds(name, wl, runnable, model, key, opts, isolate=not args.no_isolate)
        _log(f"{name}: timing the matmul ceiling again")
        ceilings[name] = best_ceiling(
            before, matmul_ceiling(dims, **rows, device=args.device, budget_s=budget)
        )
        if args.cold_start:
            # After the warm runs: every engine has then had the chance to fill its on-disk caches
            # (compiled kernels, vLLM's torch.compile cache), as on a machine that ran it before.
            cold[name] = _cold_plan(name, wl, key, runnable, opts, args.cold_repeats)
        cb = results[name].get("cbgen")
        if args.profile and cb is not None and cb.steps:
            profile[name] = profile_breakdown(cb.steps)
            step_records[name] = cb.steps

    null_rows = None
    if args.null_model:
        from cbgen.bench.null_model import measure

        key = args.model or "smollm2"
        model, _ = model_for(key)
        _log(f"null model: stub with {key}'s vocabulary, 1/16/64/256 running requests")
        from cbgen.utils import resolve_device, resolve_dtype

        device = resolve_device(args.device)
        null_rows = measure(
            model.config,
            steps=5 if args.tiny else 50,
            dtype=resolve_dtype(args.dtype, None, device),
            device=device,
        )

    report = summarize(
        workloads,
        results,
        flops,
        ceilings,
        meta,
        null_model=null_rows,
        profile=profile or None,
        cold_start=cold if args.cold_start else None,
    )
    report["skipped"] = skipped
    meta["loadavg_end"] = _loadavg()
    base = args.out / f"bench-{stamp}"
    write_json(report, base.with_suffix(".json"))
    if step_records:
        write_json({"meta": meta, "steps": step_records}, args.out / f"profile-{stamp}.json")
    if report["workloads"]:
        plot(report, base.with_suffix(".png"))
    text = markdown(report)
    base.with_suffix(".md").write_text(text)
    _log(
        f"wrote {base}.json, .md"
        + (", .png" if report["workloads"] else "")
        + (f" and profile-{stamp}.json" if step_records else "")
    )
    print(text, flush=True)
    if failed(report):
        raise SystemExit(EXIT_CHECK_FAILED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
