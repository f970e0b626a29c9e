"""The ``cbgen``, ``cbgen-noshare`` and ``cbgen-compile`` runners: cbgen through its engine API."""

from __future__ import annotations

import gc
import time
from typing import Any

from cbgen_bench.engine_result import EngineResult, RunRecord
from cbgen_bench.engine_settings import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    BenchOptions,
    kv_blocks_needed,
)
from cbgen_bench.runner_common import model_device, peak_memory, reset_peak, warmup_prompts
from cbgen_bench.workloads import Workload, vocab_size_of


def _cbgen_params(workload: Workload, i: int) -> Any:
    from cbgen.sampling_params import SamplingParams

    return SamplingParams(
        n=workload.n,
        max_tokens=workload.max_tokens[i],
        temperature=workload.temperature,
        ignore_eos=True,
        seed=None if workload.greedy else workload.seed + i,
    )


def _cbgen_llm(model: Any, num_blocks: int, share: bool, compile: bool = False, parity: bool = False) -> Any:
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
        batch_invariant=parity,
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
    completions = [sorted(finished[r].outputs, key=lambda c: c.index) for r in rids]
    tokens = [[list(c.token_ids) for c in cs] for cs in completions]
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
    record = RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs), ttft, stats, dict(s.times), tokens)
    if not workload.greedy:
        record.raw_logprobs = [[list(c.raw_logprobs) for c in cs] for cs in completions]
    return record, tokens, steps


def _regroup(rows: list | None, workload: Workload) -> list | None:
    """Independent single-sample requests back into the workload's ``[request][sample]`` shape."""
    if rows is None:
        return None
    n = workload.n
    return [[rows[i * n + j][0] for j in range(n)] for i in range(workload.num_requests)]


def run_cbgen(
    model: Any,
    workload: Workload,
    opts: BenchOptions,
    share: bool = True,
    compile: bool = False,
    parity: bool = False,
) -> EngineResult:
    """cbgen through its engine API; ``share=False`` is ``cbgen-noshare``: the ``n`` samples become
    independent requests and prefix caching is off.  ``compile=True`` is ``cbgen-compile``: decode
    steps run through ``torch.compile``; its warm-up is one untimed pass over the whole workload, so
    every batch bucket the timed runs use is compiled before the clock starts (as vLLM compiles at
    start-up).  ``parity=True`` is ``cbgen-parity``: ``batch_invariant=True``, and afterwards the
    trainer's forward over the generated sequences, plain and under ``cbgen.parity``
    (:mod:`cbgen_bench.trainer_forward`)."""
    name = "cbgen-compile" if compile else "cbgen-parity" if parity else "cbgen" if share else "cbgen-noshare"
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
            "batch_invariant": parity,
        },
    )
    device = model_device(model)
    from cbgen.sampling_params import SamplingParams

    if compile:
        t0 = time.perf_counter()
        _cbgen_once(_cbgen_llm(model, num_blocks, share, compile=True), wl, False)
        result.notes.append(
            f"warm-up pass (torch.compile of the decode buckets): {time.perf_counter() - t0:.1f} s"
        )
    else:
        # The engine kind that is timed: parity mode's first calls (its kernels' scratch, the trainer
        # side's functions) would otherwise land in its first timed run.
        warm = _cbgen_llm(model, 64, share, parity=parity)
        warm.generate(
            warmup_prompts(vocab_size_of(model)),
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        del warm
    reset_peak(device)
    for rep in range(opts.repeats):
        # A fresh engine per run: a prefix cache left warm by the previous run would flatter cbgen.
        llm = _cbgen_llm(model, num_blocks, share, compile=compile, parity=parity)
        record, _, steps = _cbgen_once(llm, wl, opts.profile and rep == opts.repeats - 1)
        result.runs.append(record)
        if steps is not None:
            result.steps = steps
        del llm
    if not share and workload.n > 1:
        for run in result.runs:
            run.tokens = _regroup(run.tokens, workload)
            run.raw_logprobs = _regroup(run.raw_logprobs, workload)
    result.tokens = result.runs[-1].tokens if result.runs else None
    result.peak_memory_bytes, result.memory_kind = peak_memory(device)
    if parity and result.tokens:
        from cbgen_bench.trainer_forward import time_trainer_forward

        sequences = [p + s for p, samples in zip(wl.prompts, result.tokens) for s in samples]
        result.settings["trainer_forward"] = tf = time_trainer_forward(model, sequences, opts.repeats)
        result.notes.append(
            f"trainer forward over the {tf['sequences']} generated sequences ({tf['tokens']} tokens): "
            f"default {tf['default_s']:.2f} s, parity {tf['parity_s']:.2f} s, parity/default {tf['parity/default']:.3f}"
        )
    return result


__all__ = ["run_cbgen"]
