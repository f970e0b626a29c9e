"""Runs one engine on one workload: in this process (:func:`run_engine`) or in a fresh one
(:func:`run_isolated`).

The engines are cbgen (:mod:`cbgen_bench.cbgen_runner`), transformers ``generate`` and transformers
continuous batching (:mod:`cbgen_bench.hf_runners`), and vLLM (:mod:`cbgen_bench.vllm_launch`,
through :mod:`cbgen_bench.vllm_runner` in another interpreter).  Each runner does one untimed
warm-up, then ``repeats`` timed runs of the whole workload, and returns an
:class:`~cbgen_bench.engine_result.EngineResult`.  Only generation is timed: model loading, engine
construction and KV-cache allocation are not (``cbgen bench --cold-start`` times those, in
:mod:`cbgen_bench.cold_start`).  No engine detokenizes.  Every engine gets the same KV capacity,
token budget and sequence cap (:mod:`cbgen_bench.engine_settings`).

Run as ``python -m cbgen_bench.engines SPEC OUT`` this module is the isolated worker: it loads the
model, runs one engine on one workload and writes the result as JSON, so that peak RSS belongs to
that engine alone.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from cbgen_bench.cbgen_runner import run_cbgen
from cbgen_bench.engine_result import EngineResult
from cbgen_bench.engine_settings import ENGINE_NAMES, BenchOptions
from cbgen_bench.hf_runners import run_hf_cb, run_hf_generate
from cbgen_bench.lifetime import run_child
from cbgen_bench.vllm_launch import run_vllm
from cbgen_bench.workloads import Workload, build_workload, load_bench_model, model_path, vocab_size_of


def run_engine(
    engine: str, workload: Workload, model: Any, opts: BenchOptions, model_key: str
) -> EngineResult:
    """Runs ``engine`` on ``workload``; failures become ``EngineResult.error`` rather than exceptions."""
    try:
        if engine == "cbgen":
            return run_cbgen(model, workload, opts, share=True)
        if engine == "cbgen-compile":
            return run_cbgen(model, workload, opts, compile=True)
        if engine == "cbgen-parity":
            return run_cbgen(model, workload, opts, parity=True)
        if engine == "cbgen-noshare":
            return run_cbgen(model, workload, opts, share=False)
        if engine == "hf-generate":
            return run_hf_generate(model, workload, opts)
        if engine == "hf-cb":
            return run_hf_cb(model, workload, opts)
        if engine == "vllm":
            folder = model_path(model_key)
            if folder is None:
                raise RuntimeError("vLLM needs a safetensors folder; the tiny model exists only in memory")
            return run_vllm(folder, workload, opts)
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINE_NAMES)}")
    except Exception as err:  # a failing engine must not sink the rest of the run
        import traceback

        traceback.print_exc()
        return EngineResult(engine, workload.name, error=f"{type(err).__name__}: {err}")


def run_isolated(engine: str, workload_name: str, model_key: str, opts: BenchOptions) -> EngineResult:
    """Runs one engine in a fresh interpreter so its peak RSS is its own."""
    spec = {
        "engine": engine,
        "workload": workload_name,
        "model": model_key,
        "options": dataclasses.asdict(opts),
    }
    with tempfile.TemporaryDirectory(prefix="cbgen-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = run_child(
            [sys.executable, "-m", "cbgen_bench.engines", str(spec_path), str(out_path)], check=False
        )
        if proc.returncode != 0 or not out_path.exists():
            return EngineResult(engine, workload_name, error=f"worker exited with status {proc.returncode}")
        result = EngineResult.from_dict(json.loads(out_path.read_text()))
    result.isolated = True
    return result


def _worker(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    opts = BenchOptions(**spec["options"])
    model, tokenizer = load_bench_model(spec["model"], opts.dtype, opts.device)
    workload = build_workload(
        spec["workload"],
        tiny=opts.tiny,
        model=spec["model"],
        vocab_size=vocab_size_of(model),
        tokenizer=tokenizer,
        scale=opts.scale,
    )
    result = run_engine(spec["engine"], workload, model, opts, spec["model"])
    Path(argv[1]).write_text(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
