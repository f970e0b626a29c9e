"""``cbgen bench --cold-start``: the wall time from process start to all outputs, per engine.

The warm benchmark times only ``generate``.  A user who runs a script once pays for much more:
starting Python, importing the library, loading the weights, building the engine (any compilation,
KV-cache allocation and profiling included) and then generating with nothing warmed up.  Here each
engine gets one fresh process per repeat that does exactly that and exits:

- ``cbgen`` and ``hf-generate``: :mod:`cbgen_bench.cold_child`, run by path with this interpreter;
- ``vllm``: :mod:`cbgen_bench.vllm_runner` with ``"cold": true`` under ``--vllm-python``.

This process notes ``time.time()`` right before it spawns the child; the child notes ``time.time()``
after its imports, after loading the model, after building the engine, and when every output is in
hand.  ``total`` is the last mark minus the spawn time.  The model folder is whatever the OS page cache
holds: after the benchmark's own model load it is warm, as on any machine that ran the model recently.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen_bench.engine_settings import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    BenchOptions,
    kv_blocks_needed,
)
from cbgen_bench.lifetime import run_child
from cbgen_bench.vllm_launch import VLLM_RUNNER, vllm_env, vllm_spec
from cbgen_bench.workloads import Workload

# Engines with a cold-start runner, in the order they are run and reported.
COLD_ENGINES: tuple[str, ...] = ("cbgen", "hf-generate", "vllm")
CHILD = Path(__file__).with_name("cold_child.py")
# Marks every child writes, in the order they must occur; "loaded" may be None (vLLM).
MARKS: tuple[str, ...] = ("started", "imported", "loaded", "engine_ready", "outputs_done")
# Phases derived from the marks (seconds), as reported.
PHASES: tuple[str, ...] = (
    "import_s",
    "load_s",
    "engine_start_s",
    "load_engine_s",
    "generate_s",
    "total_s",
    "exit_s",
)
VLLM_NOTE = "vLLM loads the weights and starts its engine inside LLM(); load and engine start are one number"


@dataclass
class ColdRun:
    """One cold process: the parent's spawn and exit times and the child's marks (all ``time.time()``)."""

    spawn: float
    marks: dict[str, float | None]
    exited: float | None = None
    output_tokens: int = 0
    peak_rss_bytes: int | None = None
    tokens: list[list[list[int]]] | None = None  # this run's [request][sample] ids (each run is checked)

    def phases(self) -> dict[str, float | None]:
        """Seconds per phase (see :func:`phases`)."""
        return phases(self.spawn, self.marks, self.exited)


@dataclass
class ColdStartResult:
    """One engine's cold starts on one workload."""

    engine: str
    workload: str
    runs: list[ColdRun] = field(default_factory=list)
    tokens: list[list[list[int]]] | None = None  # [request][sample] -> ids, from the last run
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    # Sampled workloads: per run, the check against a plain forward (logprob_check.py).
    sample_checks: list[dict[str, Any]] | None = None


def phases(
    spawn: float, marks: dict[str, float | None], exited: float | None = None
) -> dict[str, float | None]:
    """Seconds per phase from the spawn time and the child's marks.

    ``import_s`` runs from the spawn (so it holds interpreter start-up) to the end of the imports;
    ``load_s`` and ``engine_start_s`` are None when the engine cannot tell them apart, and
    ``load_engine_s`` is always their sum; ``total_s`` is spawn to outputs in hand; ``exit_s`` is the
    process's shutdown after that, which ``total_s`` leaves out.
    """
    imported, loaded = marks.get("imported"), marks.get("loaded")
    ready, done = marks.get("engine_ready"), marks.get("outputs_done")

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return {
        "import_s": span(spawn, imported),
        "load_s": span(imported, loaded),
        "engine_start_s": span(loaded, ready),
        "load_engine_s": span(imported, ready),
        "generate_s": span(ready, done),
        "total_s": span(spawn, done),
        "exit_s": span(done, exited),
    }


def marks_ordered(spawn: float, marks: dict[str, float | None]) -> bool:
    """True if spawn <= started <= imported <= loaded <= engine_ready <= outputs_done (None skipped)."""
    stamps = [spawn, *(marks[k] for k in MARKS if marks.get(k) is not None)]
    return all(a <= b for a, b in itertools.pairwise(stamps))


def median_phases(runs: list[ColdRun]) -> dict[str, float | None]:
    """Per phase, the median over ``runs`` (None if no run has it)."""
    per_run = [r.phases() for r in runs]
    out: dict[str, float | None] = {}
    for key in PHASES:
        values = [p[key] for p in per_run if p[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


# --------------------------------------------------------------------------- child processes


def child_spec(engine: str, folder: str, workload: Workload, opts: BenchOptions) -> dict[str, Any]:
    """The spec a cold child reads: the workload and the same engine settings as the warm runs."""
    if engine == "vllm":
        return {**vllm_spec(folder, workload, opts), "repeats": 1, "cold": True}
    spec: dict[str, Any] = {
        "engine": engine,
        "model": folder,
        "dtype": opts.dtype,
        "device": opts.device,
        "prompts": workload.prompts,
        "max_tokens": workload.max_tokens,
        "n": workload.n,
        "temperature": workload.temperature,
        "seed": workload.seed,
    }
    if engine == "cbgen":
        spec.update(
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=MAX_NUM_SEQS,
            block_size=BLOCK_SIZE,
            num_blocks=kv_blocks_needed(workload),
        )
    else:
        spec["batch_size"] = opts.batch_size
    return spec


def _command(engine: str, opts: BenchOptions) -> tuple[list[str], dict[str, str] | None]:
    """Interpreter and script of ``engine``'s cold child, and its environment (None: this one's)."""
    if engine == "vllm":
        if not opts.vllm_python:
            raise RuntimeError("the vllm engine needs --vllm-python PATH")
        return [opts.vllm_python, str(VLLM_RUNNER)], vllm_env()
    # By path, not -m: see cold_child's docstring.
    return [sys.executable, str(CHILD)], None


def cold_start_once(engine: str, folder: str, workload: Workload, opts: BenchOptions) -> tuple[ColdRun, dict]:
    """Spawns one cold process for ``engine`` and returns its run and raw output; raises if it fails."""
    with tempfile.TemporaryDirectory(prefix="cbgen-cold-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(child_spec(engine, folder, workload, opts)))
        cmd, env = _command(engine, opts)
        cmd += ["--spec", str(spec_path), "--out", str(out_path)]
        # Everything above is preparation a user would not do; the clock starts at the spawn.
        spawn = time.time()
        proc = run_child(cmd, timed=True, env=env, check=False)
        exited = time.time()
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"cold-start child exited with status {proc.returncode}")
        data = json.loads(out_path.read_text())
    tokens = data["tokens"]
    run = ColdRun(
        spawn=spawn,
        marks={k: data["marks"].get(k) for k in MARKS},
        exited=exited,
        output_tokens=sum(len(t) for seqs in tokens for t in seqs),
        peak_rss_bytes=data.get("peak_rss_bytes"),
        tokens=tokens,
    )
    if run.marks.get("outputs_done") is None:
        raise RuntimeError("cold-start child wrote no outputs_done mark (an old vllm_runner?)")
    return run, data


def run_cold_start(
    engine: str, folder: str, workload: Workload, opts: BenchOptions, result: ColdStartResult | None = None
) -> ColdStartResult:
    """Adds one cold start of ``engine`` to ``result`` (a new one if None); a failure becomes
    ``result.error`` rather than an exception, so one broken engine does not sink the others."""
    if result is None:
        result = ColdStartResult(engine, workload.name)
    try:
        run, data = cold_start_once(engine, folder, workload, opts)
    except Exception as err:
        import traceback

        traceback.print_exc()
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.runs.append(run)
    result.tokens = data["tokens"]
    result.settings = data.get("settings", {})
    notes = list(data.get("notes", []))
    if engine == "vllm":
        notes.append(VLLM_NOTE)
    result.notes = list(dict.fromkeys([*result.notes, *notes]))
    return result
