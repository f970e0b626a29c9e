"""``cbgen bench``: runs the built-in workloads on cbgen and its baselines and writes the report.

Examples::

    cbgen bench                                   # default suite: chat + overhead vs hf-generate, hf-cb
    cbgen bench --suite full --repeats 5          # chat, overhead, grpo (+ cbgen-noshare), mixed, long
    cbgen bench --workloads long                  # one sequence at 2k/8k/max context vs its bounds
    cbgen bench --workloads chat --vllm-python ~/venvs/vllmcpu/bin/python
    cbgen bench --null-model                      # engine overhead only (stub model)
    cbgen bench --tiny --repeats 1 --no-isolate   # seconds-long smoke run
    cbgen bench --workloads chat --cold-start     # + process start -> all outputs, per engine
    cbgen bench --engines cbgen --no-check        # numbers without a correctness reference (marked so)
    cbgen bench --workloads chat,long --neighbour nice19   # while another process holds one core
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen.cli import SETUP_ERRORS, ArgumentParser, fail, non_negative_int, positive_int
from cbgen_bench.engine_result import EngineResult
from cbgen_bench.engine_settings import ENGINE_NAMES, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, BenchOptions
from cbgen_bench.history import HISTORY_NAME, MAX_RESULT_FILES, prune
from cbgen_bench.lifetime import sigterm_unwinds
from cbgen_bench.logprob_check import check_cold, check_sampled
from cbgen_bench.long_run import bench_long
from cbgen_bench.matmul_ceiling import COLD_BYTES, best_ceiling, matmul_ceiling
from cbgen_bench.neighbour import NEIGHBOURS, busy_neighbour
from cbgen_bench.report import failed, profile_breakdown, summarize, write_json
from cbgen_bench.report_markdown import markdown
from cbgen_bench.report_plot import plot
from cbgen_bench.rounds import cold_plan, log, run_rounds
from cbgen_bench.run_meta import loadavg, run_meta
from cbgen_bench.vllm_launch import vllm_unsupported_reason
from cbgen_bench.workloads import (
    DEFAULT_MODELS,
    DEFAULT_SUITE,
    FULL_SUITE,
    WORKLOAD_NAMES,
    Workload,
    build_workload,
    load_bench_model,
    model_dims,
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
    "long": ("cbgen", "hf-generate"),
}
EXIT_CHECK_FAILED = 3
PROG = "cbgen bench"
# Loads a model key once per run: (model, tokenizer).
ModelFor = Callable[[str], tuple[Any, Any]]


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The ``cbgen bench`` argument parser."""
    p = ArgumentParser(
        prog=PROG,
        description="Benchmark cbgen against transformers (and optionally vLLM) on built-in workloads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1],
    )
    # Added in this order because --help lists them in it.
    _add_selection_args(p)
    _add_run_args(p)
    _add_extra_args(p)
    _add_cold_start_args(p)
    return p


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    """Which workloads and engines run."""
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


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """How the engines run and where the report goes."""
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs per engine; medians are reported (3)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model dtype; token-for-token checks are strict only in float32 (float32)",
    )
    p.add_argument(
        "--batch-size",
        type=non_negative_int,
        default=0,
        help="hf-generate static batch size; 0 = all prompts in one batch (0)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results"),
        help="directory for the JSON, PNG and markdown files (benchmarks/results)",
    )
    p.add_argument(
        "--keep-files",
        type=non_negative_int,
        default=MAX_RESULT_FILES,
        metavar="N",
        help=f"after the run, --out holds at most N files: every run is a line of {HISTORY_NAME} there, "
        f"and only the newest runs keep their files; 0 keeps every run's files ({MAX_RESULT_FILES})",
    )
    p.add_argument("--tiny", action="store_true", help="shrink every workload to a few prompts and tokens")
    p.add_argument(
        "--scale",
        type=_share,
        default=1.0,
        help="run this share of the chat and grpo prompts (0 < scale <= 1; for models too slow for "
        "the full sets, e.g. a 0.5B model in float32 on two cores) (1)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of a virtualenv with vLLM; adds the vllm engine (see benchmarks/README.md)",
    )


def _add_extra_args(p: argparse.ArgumentParser) -> None:
    """Profiling, the null model, and the model and device choice."""
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
        "--no-check",
        action="store_true",
        help="report numbers whose output could not be checked (no hf-generate in --engines) instead of "
        "failing; the report says NOT CHECKED in its header",
    )
    p.add_argument(
        "--neighbour",
        choices=sorted(NEIGHBOURS),
        default=None,
        help="while the engines generate, a busy process in its own session holds one core at this "
        "nice level (the ceilings are timed without it); compare with a run without it",
    )
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="run engines in this process (faster start; peak RSS is then the process's)",
    )


def _add_cold_start_args(p: argparse.ArgumentParser) -> None:
    """The end-to-end cold-start runs."""
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="also time each workload end to end: a fresh process per engine (cbgen, hf-generate, "
        "vllm) imports, loads the model folder, builds the engine and generates once, no warm-up",
    )
    p.add_argument(
        "--cold-repeats",
        type=positive_int,
        default=1,
        metavar="N",
        help="fresh processes per engine for --cold-start; medians are reported (1)",
    )


def _plan(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    if args.workloads is not None:
        names = args.workloads
    elif args.suite is None and args.null_model:
        names = []
    else:
        names = list(SUITES[args.suite or "default"])
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown:
        fail(PROG, f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    if args.engines is not None:
        bad = [e for e in args.engines if e not in ENGINE_NAMES]
        if bad:
            fail(PROG, f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINE_NAMES)}")
        if "vllm" in args.engines and not args.vllm_python:
            fail(PROG, "the vllm engine needs --vllm-python PATH")
    plan = []
    for name in names:
        engines = list(args.engines) if args.engines is not None else list(DEFAULT_ENGINES[name])
        if args.engines is None and args.vllm_python:
            engines.append("vllm")
        plan.append((name, engines))
    return plan


@dataclass
class _Collected:
    """Everything the workloads of one run produce, as :func:`~cbgen_bench.report.summarize` takes it."""

    workloads: dict[str, Workload] = field(default_factory=dict)
    results: dict[str, dict[str, EngineResult]] = field(default_factory=dict)
    flops: dict[str, dict[str, float]] = field(default_factory=dict)
    ceilings: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    step_records: dict[str, Any] = field(default_factory=dict)
    cold: dict[str, dict[str, Any]] = field(default_factory=dict)
    long: dict[str, Any] | None = None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cbgen bench``; exits with status 3 if a correctness check failed, 143 on
    SIGTERM (after stopping its child processes and removing its temporary folders)."""
    with sigterm_unwinds():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # every number checked as it is parsed
    plan = _plan(args)
    opts = BenchOptions(
        repeats=args.repeats,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        profile=args.profile,
        tiny=args.tiny,
        scale=args.scale,
        vllm_python=args.vllm_python,
        model=args.model,
    )
    meta = run_meta(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    models: dict[str, tuple[Any, Any]] = {}

    def model_for(key: str) -> tuple[Any, Any]:
        if key not in models:
            log(f"loading model {key} ({args.dtype})")
            try:
                models[key] = load_bench_model(key, args.dtype, args.device)
            except SETUP_ERRORS as exc:  # a missing --model folder, a bad --device
                fail(PROG, str(exc))
        return models[key]

    got = _Collected()
    for name, engines in plan:
        if name == "long":
            got.long = bench_long(args, engines, model_for)
        else:
            _bench_workload(args, opts, name, engines, model_for, got)
    null_rows = _null_model_rows(args, model_for) if args.null_model else None
    report = summarize(
        got.workloads,
        got.results,
        got.flops,
        got.ceilings,
        meta,
        null_model=null_rows,
        profile=got.profile or None,
        cold_start=got.cold if args.cold_start else None,
    )
    report["skipped"] = got.skipped
    if got.long is not None:
        report["long"] = got.long
    meta["loadavg_end"] = loadavg()
    text = _write_report(report, meta, got.step_records, args.out, stamp)
    _record(args.out, args.keep_files)
    print(text, flush=True)
    if failed(report):
        raise SystemExit(EXIT_CHECK_FAILED)
    return 0


def _bench_workload(
    args: argparse.Namespace,
    opts: BenchOptions,
    name: str,
    engines: list[str],
    model_for: ModelFor,
    got: _Collected,
) -> None:
    """Builds workload ``name``, times the matmul ceiling around its engines' runs, and its cold starts."""
    key = args.model or DEFAULT_MODELS[name]
    model, tokenizer = model_for(key)
    wl = build_workload(
        name,
        tiny=args.tiny,
        model=key,
        vocab_size=vocab_size_of(model),
        tokenizer=tokenizer,
        scale=args.scale,
    )
    got.workloads[name] = wl
    log(
        f"{name}: {wl.description} on {key} ({wl.prompt_tokens:,} prompt + {wl.output_tokens:,} output tokens)"
    )
    runnable = []
    for engine in engines:
        reason = vllm_unsupported_reason(model) if engine == "vllm" else None
        if reason:
            got.skipped.append({"workload": name, "engine": engine, "reason": reason})
            log(f"{name}/{engine}: skipped ({reason})")
        else:
            runnable.append(engine)
    dims = model_dims(model)
    got.flops[name] = workload_flops(wl, dims)
    rows = {
        "decode_rows": min(wl.num_sequences, MAX_NUM_SEQS),
        "prefill_rows": min(wl.prompt_tokens, MAX_NUM_BATCHED_TOKENS),
    }
    # Tiny runs (tests) time one warm copy of the weights: the cold set of thousands of tiny
    # copies cost a minute per workload on CPUs that emulate bf16.
    budget, cold = (0.03, 0) if args.tiny else (0.3, COLD_BYTES)
    # Timed before and after the engines; the better of the two is the ceiling, so a burst of
    # load from other jobs during one measurement does not lower it.
    log(f"{name}: timing the matmul ceiling")
    before = matmul_ceiling(dims, **rows, device=args.device, budget_s=budget, cold_bytes=cold)
    with busy_neighbour(args.neighbour):
        got.results[name] = run_rounds(name, wl, runnable, model, key, opts, isolate=not args.no_isolate)
    if not wl.greedy:
        log(f"{name}: checking every run's sampled tokens against a plain forward")
        check_sampled(model, wl, got.results[name], args.dtype)
    log(f"{name}: timing the matmul ceiling again")
    got.ceilings[name] = best_ceiling(
        before, matmul_ceiling(dims, **rows, device=args.device, budget_s=budget, cold_bytes=cold)
    )
    if args.cold_start:
        # After the warm runs: every engine has then had the chance to fill its on-disk caches
        # (compiled kernels, vLLM's torch.compile cache), as on a machine that ran it before.
        got.cold[name] = cold_plan(name, wl, key, runnable, opts, args.cold_repeats)
        check_cold(model, wl, got.cold[name].get("engines", {}), args.dtype)
    cb = got.results[name].get("cbgen")
    if args.profile and cb is not None and cb.steps:
        got.profile[name] = profile_breakdown(cb.steps)
        got.step_records[name] = cb.steps


def _null_model_rows(args: argparse.Namespace, model_for: ModelFor) -> list[dict[str, Any]]:
    """Engine overhead with a stub model that has the vocabulary of ``--model`` (default smollm2)."""
    from cbgen_bench.null_model import measure

    key = args.model or "smollm2"
    model, _ = model_for(key)
    log(f"null model: stub with {key}'s vocabulary, 1/16/64/256 running requests")
    from cbgen.utils import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return measure(
        model.config,
        steps=5 if args.tiny else 50,
        dtype=resolve_dtype(args.dtype, None, device),
        device=device,
    )


def _write_report(
    report: dict[str, Any], meta: dict[str, Any], step_records: dict[str, Any], out: Path, stamp: str
) -> str:
    """Writes the JSON, markdown, chart and step-profile files; returns the markdown."""
    base = out / f"bench-{stamp}"
    write_json(report, base.with_suffix(".json"))
    if step_records:
        write_json({"meta": meta, "steps": step_records}, out / f"profile-{stamp}.json")
    if report["workloads"]:
        plot(report, base.with_suffix(".png"))
    text = markdown(report)
    base.with_suffix(".md").write_text(text)
    log(
        f"wrote {base}.json, .md"
        + (", .png" if report["workloads"] else "")
        + (f" and profile-{stamp}.json" if step_records else "")
    )
    return text


def _record(out: Path, keep_files: int) -> None:
    """Appends the run just written to ``out``'s history and drops the files of the oldest runs."""
    plan = prune(out, max_files=keep_files)
    log(
        f"added {len(plan.appended)} run(s) to {out / HISTORY_NAME}"
        + (f"; deleted the files of {', '.join(f'bench-{s}' for s in plan.moved)}" if plan.moved else "")
    )


if __name__ == "__main__":
    sys.exit(main())
