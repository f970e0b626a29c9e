"""The transformers runners: ``hf-generate`` (static batches) and ``hf-cb`` (continuous batching)."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from cbgen_bench.cold_child import left_pad
from cbgen_bench.engine_result import EngineResult, RunRecord
from cbgen_bench.engine_settings import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    BenchOptions,
    kv_blocks_needed,
)
from cbgen_bench.runner_common import model_device, peak_memory, reset_peak, sync, warmup_prompts
from cbgen_bench.workloads import Workload, vocab_size_of


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

    device = model_device(model)
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
    sync(device)
    wall = time.perf_counter() - t0
    return RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs), tokens=tokens), tokens


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
    device = model_device(model)
    warm = dataclasses.replace(workload, prompts=warmup_prompts(vocab_size_of(model)), max_tokens=[4, 4], n=1)
    _hf_generate_once(model, warm, 0)
    reset_peak(device)
    tokens = None
    for _ in range(opts.repeats):
        record, tokens = _hf_generate_once(model, workload, opts.batch_size)
        result.runs.append(record)
    result.tokens = tokens
    result.peak_memory_bytes, result.memory_kind = peak_memory(device)
    return result


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
    return RunRecord(wall, sum(len(t) for seqs in tokens for t in seqs), ttft, tokens=tokens), tokens


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
    device = model_device(model)
    warm = dataclasses.replace(workload, prompts=warmup_prompts(vocab_size_of(model)), max_tokens=[4, 4], n=1)
    _hf_cb_once(model, warm, 64)
    reset_peak(device)
    tokens = None
    for _ in range(opts.repeats):
        record, tokens = _hf_cb_once(model, workload, num_blocks)
        result.runs.append(record)
    result.tokens = tokens
    result.peak_memory_bytes, result.memory_kind = peak_memory(device)
    return result


__all__ = ["run_hf_cb", "run_hf_generate"]
