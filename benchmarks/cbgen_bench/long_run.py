"""Runs the ``long`` workload for ``cbgen bench``: the bounds, then each engine's rounds (see
:mod:`cbgen_bench.long_context` for the cases and what is measured)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cbgen_bench.engine_settings import MAX_NUM_BATCHED_TOKENS
from cbgen_bench.long_context import (
    CaseTiming,
    LongCase,
    bounds,
    case_prompts,
    long_cases,
    memory_bandwidth,
    run_in_process,
    run_vllm_long,
    summarize_long,
    warm_up,
)
from cbgen_bench.matmul_ceiling import COLD_BYTES, best_gemm
from cbgen_bench.neighbour import busy_neighbour
from cbgen_bench.rounds import log
from cbgen_bench.run_meta import loadavg
from cbgen_bench.vllm_launch import vllm_unsupported_reason
from cbgen_bench.workloads import DEFAULT_MODELS, model_dims, model_path, vocab_size_of

IN_PROCESS = ("cbgen", "hf-generate")


def _text_config(model: Any) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _machine(args: argparse.Namespace, dims: Any, prefill_rows: int) -> dict[str, Any]:
    """Memory bandwidth and the best prefill GEMM, measured now."""
    bw = memory_bandwidth(64 << 20 if args.tiny else 512 << 20)
    budget, cold = (0.03, 0) if args.tiny else (0.3, COLD_BYTES)
    gemm = best_gemm(dims.layer_linears, prefill_rows, args.dtype, args.device, budget, cold)
    return {
        **bw,
        "bandwidth_gbs": max(bw["read_gbs"], bw["copy_gbs"]),
        "prefill_gflops": gemm["gflops"],
        "prefill_gemm": gemm["gemm"],
        "prefill_candidates": gemm["all"],
    }


def _best_of(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The faster of two machine measurements, per quantity (a burst of load lowers only one)."""
    out = dict(a)
    for key in ("read_gbs", "copy_gbs", "bandwidth_gbs"):
        out[key] = max(a[key], b[key])
    if b["prefill_gflops"] > a["prefill_gflops"]:
        out.update(prefill_gflops=b["prefill_gflops"], prefill_gemm=b["prefill_gemm"])
    return out


def _log_case(engine: str, case: LongCase, t: CaseTiming) -> None:
    log(f"long/{engine} {case.name}: first token {t.ttft_s[-1]:.2f} s, decode {t.decode_ms[-1]:.1f} ms/token")


def bench_long(
    args: argparse.Namespace, engines: list[str], model_for: Callable[[str], tuple[Any, Any]]
) -> dict:
    """The ``long`` section of the report for ``engines`` (vllm runs when ``--vllm-python`` is given)."""
    key = args.model or DEFAULT_MODELS["long"]
    model, _ = model_for(key)
    if args.vllm_python and "vllm" not in engines:
        engines = [*engines, "vllm"]
    cfg = _text_config(model)
    cases = long_cases(int(getattr(cfg, "max_position_embeddings", 8192)), args.tiny)
    vocab = vocab_size_of(model)
    prompts = case_prompts(cases, vocab, args.repeats)
    dims = model_dims(model)
    prefill_rows = min(MAX_NUM_BATCHED_TOKENS, max(c.prompt_len for c in cases))
    log(f"long: {', '.join(c.name for c in cases)} on {key}; measuring bandwidth and the prefill GEMM")
    machine = _machine(args, dims, prefill_rows)
    with busy_neighbour(getattr(args, "neighbour", None)):
        timings = _run_engines(args, engines, model, key, cases, prompts, vocab)
    machine = _best_of(machine, _machine(args, dims, prefill_rows))
    elem = 2 if args.dtype == "bfloat16" else 4
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or dims.num_heads)
    case_bounds = [
        bounds(c, dims, kv_heads, elem, machine["bandwidth_gbs"], machine["prefill_gflops"]) for c in cases
    ]
    machine["loadavg_end"] = loadavg()
    return summarize_long(cases, timings, case_bounds, machine)


def _run_engines(
    args: argparse.Namespace,
    engines: list[str],
    model: Any,
    key: str,
    cases: list,
    prompts: list,
    vocab: int,
) -> dict[str, list[CaseTiming] | str]:
    """Each engine's timings over ``cases`` (an error's text where it failed), rounds interleaved."""
    timings: dict[str, list[CaseTiming] | str] = {}
    local = [e for e in engines if e in IN_PROCESS]
    for engine in local:
        warm_up(engine, model, vocab)
        timings[engine] = [CaseTiming() for _ in cases]
    for rnd in range(args.repeats):  # round-robin, so a change in machine load hits every engine
        for engine in local:
            if isinstance(timings[engine], str):
                continue
            try:
                part = run_in_process(engine, model, cases, [p[rnd] for p in prompts])
            except Exception as err:  # a failing engine must not sink the rest of the run
                timings[engine] = f"{type(err).__name__}: {err}"
                log(f"long/{engine}: ERROR {timings[engine]}")
                continue
            for case, into, got in zip(cases, timings[engine], part):
                into.ttft_s += got.ttft_s
                into.decode_ms += got.decode_ms
                into.tokens += got.tokens
                _log_case(engine, case, got)
    if "vllm" in engines:
        reason = vllm_unsupported_reason(model) or (None if args.vllm_python else "no --vllm-python")
        folder = model_path(key)
        try:
            if reason or folder is None:
                raise RuntimeError(reason or "vLLM needs a safetensors folder")
            timings["vllm"] = run_vllm_long(args.vllm_python, folder, args.dtype, cases, prompts)
            for case, t in zip(cases, timings["vllm"]):
                _log_case("vllm", case, t)
        except Exception as err:
            timings["vllm"] = f"{type(err).__name__}: {err}"
            log(f"long/vllm: ERROR {timings['vllm']}")
    return timings


__all__ = ["bench_long"]
