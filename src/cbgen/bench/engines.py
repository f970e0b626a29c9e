"""Engine runners: cbgen, cbgen without sharing, transformers ``generate``, transformers continuous
batching, and vLLM (through :mod:`cbgen.bench.vllm_runner` in another interpreter).

Each runner does one untimed warm-up, then ``repeats`` timed runs of the whole workload, and returns an
:class:`EngineResult`.  Only generation is timed: model loading, engine construction and KV-cache
allocation are not (``cbgen bench --cold-start`` times those, in :mod:`cbgen.bench.cold_start`).  No engine detokenizes.  Every engine gets the same KV capacity (enough for the
whole workload at once), the same per-step token budget (2,048) and the same sequence cap (256).

Run as ``python -m cbgen.bench.engines SPEC OUT`` this module is the isolated worker: it loads the
model, runs one engine on one workload and writes the result as JSON, so that peak RSS belongs to
that engine alone.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen.bench.cold_child import left_pad
from cbgen.bench.workloads import Workload, build_workload, load_bench_model, model_path, vocab_size_of

ENGINE_NAMES: tuple[str, ...] = ("cbgen", "cbgen-compile", "cbgen-noshare", "hf-generate", "hf-cb", "vllm")
BASELINES: tuple[str, ...] = ("hf-generate", "hf-cb", "vllm", "cbgen-noshare")
REFERENCE_ENGINE = "hf-generate"

MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
BLOCK_SIZE = 16
# vLLM's CPU attention rejects smaller heads ("Unsupported CPU attention configuration").
VLLM_MIN_HEAD_DIM = 32


@dataclass
class BenchOptions:
    """Settings shared by every runner."""

    repeats: int = 3
    dtype: str = "float32"
    device: str | None = None
    batch_size: int = 0  # hf-generate; 0 = all prompts in one batch
    profile: bool = False
    tiny: bool = False
    vllm_python: str | None = None
    model: str | None = None  # overrides every workload's model key


@dataclass
class RunRecord:
    """One timed run of a whole workload."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float] | None = None
    stats: dict[str, Any] | None = None
    phase_s: dict[str, float] | None = None


@dataclass
class EngineResult:
    """What one engine did on one workload over all repeats."""

    engine: str
    workload: str
    runs: list[RunRecord] = field(default_factory=list)
    tokens: list[list[list[int]]] | None = None  # [request][sample] -> ids, from the last run
    peak_memory_bytes: int | None = None
    memory_kind: str = "rss"  # "rss" | "cuda"
    isolated: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] | None = None  # per-step records of the last run (--profile)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineResult:
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["runs"] = [RunRecord(**r) for r in data.get("runs", [])]
        return cls(**data)


# --------------------------------------------------------------------------- helpers


def kv_blocks_needed(workload: Workload, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold every sequence of the workload at once (prefix sharing not assumed)."""
    per_request = [-(-(len(p) + m + 1) // block_size) for p, m in zip(workload.prompts, workload.max_tokens)]
    return sum(per_request) * workload.n + 16


def _peak_memory(device: Any) -> tuple[int, str]:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


def _reset_peak(device: Any) -> None:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: Any) -> None:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model: Any) -> Any:
    return next(model.parameters()).device


def _warmup_prompts(vocab_size: int) -> list[list[int]]:
    # Ids near the top of the vocabulary: no workload prompt starts with them, so a warm-up never
    # seeds a prefix cache that the timed run could hit.
    top = vocab_size - 1
    return [[top - (i % 7) for i in range(24)], [top - 1 - (i % 5) for i in range(9)]]


# --------------------------------------------------------------------------- cbgen


def _cbgen_params(workload: Workload, i: int) -> Any:
    from cbgen.sampling_params import SamplingParams

    return SamplingParams(
        n=workload.n,
        max_tokens=workload.max_tokens[i],
        temperature=workload.temperature,
        ignore_eos=True,
        seed=None if workload.greedy else workload.seed + i,
    )


def _cbgen_llm(model: Any, num_blocks: int, share: bool, compile: bool = False) -> Any:
    from cbgen.llm import LLM

    return LLM(
        model,
        None,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        enable_prefix_caching=share,
        compile=compile,
    )


def _cbgen_once(llm: Any, workload: Workload, record_steps: bool) -> tuple[RunRecord, list, list | None]:
    """Drives the engine step by step so each request's first-token time can be read."""
    engine = llm.engine
    gc.collect()
    t0 = time.perf_counter()
    rids, groups = [], []
    for i, prompt in enumerate(workload.prompts):
        rid = engine.add_request(prompt, _cbgen_params(workload, i))
        rids.append(rid)
        groups.append(engine.groups[rid])
    finished: dict[str, Any] = {}
    steps: list[dict[str, Any]] | None = [] if record_steps else None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if steps is not None:
            last = engine.last_step
            steps.append(
                {
                    "step": last.step,
                    "num_seqs": last.num_seqs,
                    "num_tokens": last.num_tokens,
                    "num_decode": last.num_decode,
                    "num_prefill_tokens": last.num_prefill_tokens,
                    "num_sampled": last.num_sampled,
                    "running": last.running,
                    "waiting": last.waiting,
                    "preempted": last.preempted,
                    "times": dict(last.times),
                }
            )
    wall = time.perf_counter() - t0
    ttft = []
    for group in groups:
        firsts = [s.first_token_time for s in group.samples if s.first_token_time is not None]
        if firsts:
            ttft.append(min(firsts) - min(s.arrival_time for s in group.samples))
    tokens = [[list(c.token_ids) for c in sorted(finished[r].outputs, key=lambda c: c.index)] for r in rids]
    s = engine.stats
    stats = {
        "steps": s.steps,
        "mean_batch_size": s.mean_batch_size,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "prefix_cache_hits": s.prefix_cache_hits,
        "preemptions": s.preemptions,
        "prompt_tokens": s.prompt_tokens,
        "prompt_tokens_computed": s.prompt_tokens_computed,
        "generated_tokens": s.generated_tokens,
        "requests_failed": s.requests_failed,
    }
    record = RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs), ttft, stats, dict(s.times))
    return record, tokens, steps


def run_cbgen(
    model: Any, workload: Workload, opts: BenchOptions, share: bool = True, compile: bool = False
) -> EngineResult:
    """cbgen through its engine API; ``share=False`` is ``cbgen-noshare``: the ``n`` samples become
    independent requests and prefix caching is off.  ``compile=True`` is ``cbgen-compile``: decode
    steps run through ``torch.compile``; its warm-up is one untimed pass over the whole workload, so
    every batch bucket the timed runs use is compiled before the clock starts (as vLLM compiles at
    start-up)."""
    name = "cbgen-compile" if compile else "cbgen" if share else "cbgen-noshare"
    wl = workload if share else workload.expanded()
    num_blocks = kv_blocks_needed(wl)
    result = EngineResult(
        name,
        workload.name,
        settings={
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "block_size": BLOCK_SIZE,
            "num_blocks": num_blocks,
            "enable_prefix_caching": share,
            "n_as_independent_requests": not share and workload.n > 1,
            "compile": compile,
        },
    )
    device = _model_device(model)
    from cbgen.sampling_params import SamplingParams

    if compile:
        t0 = time.perf_counter()
        _cbgen_once(_cbgen_llm(model, num_blocks, share, compile=True), wl, False)
        result.notes.append(
            f"warm-up pass (torch.compile of the decode buckets): {time.perf_counter() - t0:.1f} s"
        )
    else:
        warm = _cbgen_llm(model, 64, share)
        warm.generate(
            _warmup_prompts(vocab_size_of(model)),
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        del warm
    tokens = None
    _reset_peak(device)
    for rep in range(opts.repeats):
        # A fresh engine per run: a prefix cache left warm by the previous run would flatter cbgen.
        llm = _cbgen_llm(model, num_blocks, share, compile=compile)
        record, tokens, steps = _cbgen_once(llm, wl, opts.profile and rep == opts.repeats - 1)
        result.runs.append(record)
        if steps is not None:
            result.steps = steps
        del llm
    if tokens is not None and not share and workload.n > 1:
        # Regroup the independent requests into the workload's [request][sample] shape.
        tokens = [
            [tokens[i * workload.n + j][0] for j in range(workload.n)] for i in range(workload.num_requests)
        ]
    result.tokens = tokens
    result.peak_memory_bytes, result.memory_kind = _peak_memory(device)
    return result


# --------------------------------------------------------------------------- transformers generate


def _pad_id(model: Any) -> int:
    for cfg in (getattr(model, "generation_config", None), model.config):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def _hf_sampling_kwargs(workload: Workload) -> dict[str, Any]:
    if workload.greedy:
        return {"do_sample": False}
    # top_k defaults to 50 in transformers; cbgen and vLLM sample from the full distribution.
    return {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}


def _hf_generate_once(model: Any, workload: Workload, batch_size: int) -> tuple[RunRecord, list]:
    import torch
    from transformers import GenerationConfig

    device = _model_device(model)
    pad = _pad_id(model)
    count = workload.num_requests
    bs = batch_size if batch_size > 0 else count
    tokens: list[list[list[int]]] = []
    gc.collect()
    t0 = time.perf_counter()
    for start in range(0, count, bs):
        prompts = workload.prompts[start : start + bs]
        wants = workload.max_tokens[start : start + bs]
        ids, mask = left_pad(prompts, pad)
        # Static batching: every row runs as long as the longest request of its batch.
        new = max(wants)
        config = GenerationConfig(
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=[],
            pad_token_id=pad,
            num_return_sequences=workload.n,
            **_hf_sampling_kwargs(workload),
        )
        if not workload.greedy:
            torch.manual_seed(workload.seed + start)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
        rows = out[:, ids.shape[1] :].tolist()
        for i, want in enumerate(wants):
            tokens.append([rows[i * workload.n + j][:want] for j in range(workload.n)])
    _sync(device)
    wall = time.perf_counter() - t0
    return RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs)), tokens


def run_hf_generate(model: Any, workload: Workload, opts: BenchOptions) -> EngineResult:
    """transformers ``generate()`` with static batches, left padding and exactly N new tokens per row."""
    bs = opts.batch_size if opts.batch_size > 0 else workload.num_requests
    result = EngineResult(
        "hf-generate",
        workload.name,
        settings={
            "batch_size": bs,
            "padding": "left",
            "attn_implementation": model.config._attn_implementation,
        },
    )
    if len(set(workload.max_tokens)) > 1:
        result.notes.append(
            "static batching: each batch generates its longest request's length; extra tokens dropped"
        )
    device = _model_device(model)
    warm = dataclasses.replace(
        workload, prompts=_warmup_prompts(vocab_size_of(model)), max_tokens=[4, 4], n=1
    )
    _hf_generate_once(model, warm, 0)
    _reset_peak(device)
    tokens = None
    for _ in range(opts.repeats):
        record, tokens = _hf_generate_once(model, workload, opts.batch_size)
        result.runs.append(record)
    result.tokens = tokens
    result.peak_memory_bytes, result.memory_kind = _peak_memory(device)
    return result


# --------------------------------------------------------------------------- transformers continuous batching


def _hf_cb_configs(model: Any, workload: Workload, num_blocks: int) -> tuple[Any, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max(workload.max_tokens),
        eos_token_id=-1,
        pad_token_id=_pad_id(model),
        num_return_sequences=workload.n,
        **_hf_sampling_kwargs(workload),
    )
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
        allow_block_sharing=True,
        seed=workload.seed,
    )
    return gen, cb


def _hf_cb_once(model: Any, workload: Workload, num_blocks: int) -> tuple[RunRecord, list]:
    gen, cb = _hf_cb_configs(model, workload, num_blocks)
    expected = workload.num_sequences
    # The manager (cache allocation, thread start) is set up before the clock starts, as for cbgen.
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        gc.collect()
        t0 = time.perf_counter()
        rids = [
            manager.add_request(input_ids=p, max_new_tokens=m, record_timestamps=True, eos_token_id=-1)
            for p, m in zip(workload.prompts, workload.max_tokens)
        ]
        results: dict[str, Any] = {}
        while len(results) < expected:
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"hf-cb stopped with {len(results)}/{expected} sequences finished")
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"hf-cb request {out.request_id} failed: {out.error}")
                results[out.request_id] = out
        wall = time.perf_counter() - t0
    tokens, ttft = [], []
    for rid in rids:
        # Children are forked from the parent; their ids are f"{rid}__child#{i}".
        ids = [rid] + [f"{rid}__child#{i}" for i in range(workload.n - 1)]
        tokens.append([list(results[i].generated_tokens) for i in ids])
        parent = results[rid]
        stamps = [results[i].timestamps[0] for i in ids if results[i].timestamps]
        if stamps:
            ttft.append(min(stamps) - parent.created_time)
    return RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs), ttft), tokens


def run_hf_cb(model: Any, workload: Workload, opts: BenchOptions) -> EngineResult:
    """transformers continuous batching (``ContinuousBatchingManager``, as ``generate_batch`` uses it)."""
    num_blocks = kv_blocks_needed(workload)
    _, cb = _hf_cb_configs(model, workload, num_blocks)
    result = EngineResult(
        "hf-cb",
        workload.name,
        settings={
            "page_size": cb.page_size,
            "num_blocks": cb.num_blocks,
            "max_batch_tokens": cb.max_batch_tokens,
            "max_requests_per_batch": cb.max_requests_per_batch,
            "allow_block_sharing": cb.allow_block_sharing,
        },
    )
    device = _model_device(model)
    warm = dataclasses.replace(
        workload, prompts=_warmup_prompts(vocab_size_of(model)), max_tokens=[4, 4], n=1
    )
    _hf_cb_once(model, warm, 64)
    _reset_peak(device)
    tokens = None
    for _ in range(opts.repeats):
        record, tokens = _hf_cb_once(model, workload, num_blocks)
        result.runs.append(record)
    result.tokens = tokens
    result.peak_memory_bytes, result.memory_kind = _peak_memory(device)
    return result


# --------------------------------------------------------------------------- vLLM


def vllm_unsupported_reason(model: Any) -> str | None:
    """Why vLLM's CPU build cannot run ``model`` (None if it can)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim < VLLM_MIN_HEAD_DIM:
        return f"vLLM CPU attention needs head_dim >= {VLLM_MIN_HEAD_DIM}; this model has {head_dim}"
    return None


VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_spec(folder: str, workload: Workload, opts: BenchOptions) -> dict[str, Any]:
    """The JSON spec :mod:`cbgen.bench.vllm_runner` reads for ``workload`` on the model in ``folder``."""
    return {
        "model": folder,
        "dtype": opts.dtype,
        "prompts": workload.prompts,
        "max_tokens": workload.max_tokens,
        "n": workload.n,
        "temperature": workload.temperature,
        "seed": workload.seed,
        "repeats": opts.repeats,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
    }


def vllm_env() -> dict[str, str]:
    """This process's environment with vLLM's CPU settings added, for the vLLM subprocess only."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if os.environ.get("VLLM_LD_PRELOAD"):
        # Preloads (tcmalloc, libiomp5) meant for vLLM alone: setting LD_PRELOAD on the whole
        # benchmark would change the allocator under cbgen and transformers too.
        env["LD_PRELOAD"] = os.environ["VLLM_LD_PRELOAD"]
    return env


def run_vllm(folder: str, workload: Workload, opts: BenchOptions) -> EngineResult:
    """vLLM in ``opts.vllm_python`` (its own virtualenv) running :mod:`cbgen.bench.vllm_runner`."""
    spec = vllm_spec(folder, workload, opts)
    with tempfile.TemporaryDirectory(prefix="cbgen-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [opts.vllm_python, str(VLLM_RUNNER), "--spec", str(spec_path), "--out", str(out_path)],
            env=vllm_env(),
            check=False,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vllm_runner exited with status {proc.returncode}")
        data = json.loads(out_path.read_text())
    result = EngineResult("vllm", workload.name, isolated=True, settings=data.get("settings", {}))
    result.runs = [RunRecord(r["wall_s"], r["output_tokens"], r.get("ttft_s")) for r in data["runs"]]
    result.tokens = data["tokens"]
    result.peak_memory_bytes = data.get("peak_rss_bytes")
    result.notes.extend(data.get("notes", []))
    return result


# --------------------------------------------------------------------------- matmul ceiling


def time_matmuls(
    shapes: list[tuple[int, int]], rows: int, dtype: str, device: Any = None, budget_s: float = 0.2
) -> float:
    """GFLOP/s of ``F.linear`` over ``shapes`` ((in, out) weights) with ``rows`` input rows: the
    median of three timed batches, each sized to take at least ``budget_s / 12``."""
    import statistics

    import torch

    from cbgen.utils import resolve_dtype

    dt = resolve_dtype(dtype, None, device or "cpu")
    dev = torch.device(device or "cpu")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).to(dtype=dt, device=dev) for i, o in shapes]
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype=dt, device=dev) for i, _ in shapes}
    flops = sum(2 * rows * i * o for i, o in shapes)

    def once(reps: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
        _sync(dev)
        return time.perf_counter() - t0

    # Calibrate by doubling rather than from one probe: a single fast probe on a busy machine
    # would otherwise ask for far more repetitions than the budget allows.
    once(1)
    reps = 1
    while once(reps) < budget_s / 12 and reps < 1 << 16:
        reps *= 2
    seconds = statistics.median(once(reps) / reps for _ in range(3))
    return flops / seconds / 1e9


def matmul_ceiling(
    dims: Any, decode_rows: int, prefill_rows: int, device: Any = None, budget_s: float = 0.2
) -> dict[str, Any]:
    """Measured matmul throughput at the model's decode shapes (``decode_rows`` rows through one
    layer's matmuls plus the LM head) and prefill shapes (``prefill_rows`` rows, no LM head), for
    float32 and bfloat16."""
    out: dict[str, Any] = {"decode_rows": decode_rows, "prefill_rows": prefill_rows}
    decode_shapes = [*dims.layer_linears, (dims.hidden_size, dims.vocab_size)]
    for dtype in ("float32", "bfloat16"):
        out[dtype] = {
            "decode_gflops": time_matmuls(decode_shapes, decode_rows, dtype, device, budget_s),
            "prefill_gflops": time_matmuls(dims.layer_linears, prefill_rows, dtype, device, budget_s),
        }
    return out


def merge_results(parts: list[EngineResult]) -> EngineResult:
    """Combines one engine's results from several calls (one per round) into one result."""
    first = parts[0]
    ok = [p for p in parts if p.error is None]
    merged = EngineResult(
        first.engine,
        first.workload,
        runs=[run for p in parts for run in p.runs],
        tokens=ok[-1].tokens if ok else None,
        memory_kind=first.memory_kind,
        isolated=all(p.isolated for p in parts),
        settings=first.settings,
        notes=list(dict.fromkeys(n for p in parts for n in p.notes)),
        steps=next((p.steps for p in reversed(parts) if p.steps), None),
        error=next((p.error for p in parts if p.error), None),
    )
    peaks = [p.peak_memory_bytes for p in parts if p.peak_memory_bytes]
    merged.peak_memory_bytes = max(peaks) if peaks else None
    return merged


def best_ceiling(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per dtype and shape, the higher of two :func:`matmul_ceiling` measurements."""
    out = dict(a)
    for dtype in ("float32", "bfloat16"):
        out[dtype] = {k: max(a[dtype][k], b[dtype][k]) for k in a[dtype]}
    return out


# --------------------------------------------------------------------------- dispatch


def run_engine(
    engine: str, workload: Workload, model: Any, opts: BenchOptions, model_key: str
) -> EngineResult:
    """Runs ``engine`` on ``workload``; failures become ``EngineResult.error`` rather than exceptions."""
    try:
        if engine == "cbgen":
            return run_cbgen(model, workload, opts, share=True)
        if engine == "cbgen-compile":
            return run_cbgen(model, workload, opts, compile=True)
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
        proc = subprocess.run(
            [sys.executable, "-m", "cbgen.bench.engines", str(spec_path), str(out_path)], check=False
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
    )
    result = run_engine(spec["engine"], workload, model, opts, spec["model"])
    Path(argv[1]).write_text(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
