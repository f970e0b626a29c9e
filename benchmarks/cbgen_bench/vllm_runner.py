"""Runs one benchmark workload on vLLM and writes the timings and token ids as JSON.

This file is executed by the vLLM virtualenv's interpreter (``cbgen bench --vllm-python PATH``), which
has no cbgen installed, so it imports nothing from cbgen: only the standard library and vLLM.

    python vllm_runner.py --spec spec.json --out result.json

``spec.json`` holds ``model`` (a safetensors folder), ``dtype``, ``prompts`` (token-id lists),
``max_tokens`` (one per prompt), ``n``, ``temperature``, ``seed``, ``repeats``,
``max_num_batched_tokens`` and ``max_num_seqs``.  Only ``generate`` is timed, after a short warm-up.

With ``"cold": true`` (``cbgen bench --cold-start``) there is no warm-up and one ``generate``; the
output then also holds ``marks``: ``time.time()`` when this script started running, after ``import
vllm``, after ``LLM(...)`` returned (vLLM loads the weights *and* starts its engine, compiling and
profiling included, inside that one call, so the two cannot be told apart from here), and when the
outputs were in hand.  The parent subtracts its own spawn time from these.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

# Taken before anything heavy is imported: the interpreter is up and reading this file.
STARTED = time.time()

# Must be set before vLLM is imported.  0 reserved CPUs lets the model use every core (vLLM keeps one
# for its scheduler by default); 2 GiB of KV cache is plenty for the built-in workloads.
ENV_DEFAULTS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (vLLM runs its engine core in a child process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _peak_rss(pid: int) -> int | None:
    """VmHWM (peak resident set) of one process, in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_tree() -> int:
    """Sum of the peak RSS of this process and its live descendants (each process's own peak)."""
    me = os.getpid()
    total = 0
    for pid in [me, *_descendants(me)]:
        total += _peak_rss(pid) or 0
    if total == 0:
        total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return total


def _ttft(output: Any) -> float | None:
    """First-token latency from vLLM's request metrics, when this vLLM version records them."""
    metrics = getattr(output, "metrics", None)
    if metrics is None:
        return None
    latency = getattr(metrics, "first_token_latency", None)  # V1 RequestStateStats
    if latency:
        return float(latency)
    first = getattr(metrics, "first_token_time", None)  # V0 RequestMetrics, both wall-clock
    arrival = getattr(metrics, "arrival_time", None)
    return float(first - arrival) if first and arrival else None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Loads the model, warms up, then times ``repeats`` calls of ``generate`` over the whole workload.

    A cold spec (``"cold": true``) skips the warm-up, runs ``generate`` once and records ``marks``.
    """
    cold = bool(spec.get("cold"))
    marks: dict[str, float | None] = {"started": STARTED}
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm import LLM, SamplingParams

    marks["imported"] = time.time()
    llm = _start_llm(LLM, spec)
    marks["loaded"] = None  # inside LLM(), together with the engine start
    marks["engine_ready"] = time.time()
    if spec.get("mode") == "long":
        return {"requests": _one_at_a_time(llm, SamplingParams, spec), "settings": _settings(vllm, spec)}
    if not cold:
        warm = [{"prompt_token_ids": [17, 18, 19, 20, 21, 22, 23, 24]}, {"prompt_token_ids": [31, 32, 33]}]
        llm.generate(warm, [_params(SamplingParams, spec, 4, 1) for _ in warm], use_tqdm=False)
    runs, tokens = _timed_runs(llm, SamplingParams, spec, cold, marks)
    return {
        "cold": cold,
        "marks": marks,
        "runs": runs,
        "tokens": tokens,
        "peak_rss_bytes": peak_rss_tree(),
        "settings": _settings(vllm, spec),
        "notes": ["peak RSS: sum of VmHWM of the vLLM process and its engine-core children"],
    }


def _settings(vllm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "vllm": getattr(vllm, "__version__", "?"),
        **{k: os.environ.get(k) for k in ENV_DEFAULTS},
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens", 2048),
        "max_num_seqs": spec.get("max_num_seqs", 256),
        "enable_prefix_caching": True,
    }


def _one_at_a_time(llm: Any, params_class: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt alone through the engine's step loop (the ``long`` workload), after one short
    warm-up request: its first-token time (seen when a step first returns a token) and its wall time.
    vLLM's offline request metrics are empty unless stats logging is on, so the steps are watched."""
    engine = llm.llm_engine
    out = []
    warm = [{"prompt_token_ids": [17, 18, 19, 20, 21, 22, 23, 24]}]
    llm.generate(warm, [_params(params_class, spec, 4, 1)], use_tqdm=False)
    for i, (prompt, max_tokens) in enumerate(zip(spec["prompts"], spec["max_tokens"])):
        t0 = time.perf_counter()
        engine.add_request(
            f"long-{i}", {"prompt_token_ids": list(prompt)}, _params(params_class, spec, max_tokens, 1)
        )
        first, tokens = None, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if first is None and o.outputs and len(o.outputs[0].token_ids):
                    first = time.perf_counter() - t0
                if o.finished:
                    tokens = list(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        out.append({"ttft_s": first if first is not None else wall, "wall_s": wall, "tokens": tokens})
    return out


def _start_llm(llm_class: Any, spec: dict[str, Any]) -> Any:
    """``vllm.LLM`` for the spec's model: loads the weights and starts the engine."""
    budget = spec.get("max_num_batched_tokens", 2048)
    longest = max(len(p) + m for p, m in zip(spec["prompts"], spec["max_tokens"]))
    return llm_class(
        model=spec["model"],
        dtype=spec["dtype"],
        seed=spec.get("seed", 0),
        # A short context keeps vLLM's start-up checks happy whether or not chunked prefill is on
        # (without it, the token budget must cover max_model_len).
        max_model_len=max(budget, longest),
        max_num_batched_tokens=max(budget, longest),
        max_num_seqs=spec.get("max_num_seqs", 256),
        enable_prefix_caching=True,
    )


def _params(params_class: Any, spec: dict[str, Any], max_tokens: int, n: int) -> Any:
    """``vllm.SamplingParams`` for one request of the spec."""
    # vLLM's top_k/top_p defaults already sample from the full distribution, as cbgen does.
    sampled = spec["temperature"] > 0
    return params_class(
        n=n,
        temperature=spec["temperature"],
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        seed=spec.get("seed", 0) if sampled else None,
    )


def _timed_runs(
    llm: Any, params_class: Any, spec: dict[str, Any], cold: bool, marks: dict[str, float | None]
) -> tuple[list[dict[str, Any]], list[list[list[int]]]]:
    """The timed ``generate`` calls (one if cold), each with its token ids, and the last call's ids."""
    runs, tokens = [], []
    for _ in range(1 if cold else int(spec.get("repeats", 3))):
        # A warm prefix cache from the previous repeat would flatter the later ones (a cold run has none).
        if not cold and hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()
        batch = [{"prompt_token_ids": list(p)} for p in spec["prompts"]]
        sampling = [_params(params_class, spec, m, spec.get("n", 1)) for m in spec["max_tokens"]]
        t0 = time.perf_counter()
        outputs = llm.generate(batch, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        marks["outputs_done"] = time.time()
        tokens = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]
        ttft = [t for t in (_ttft(o) for o in outputs) if t is not None]
        runs.append(
            {
                "wall_s": wall,
                "output_tokens": sum(len(t) for seqs in tokens for t in seqs),
                "ttft_s": ttft or None,
                "tokens": tokens,
            }
        )
    return runs, tokens


def main() -> None:
    """Command-line entry: ``--spec IN.json --out OUT.json``."""
    parser = argparse.ArgumentParser(description="Run one cbgen benchmark workload on vLLM.")
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    result = run(json.loads(args.spec.read_text()))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    # vLLM starts worker processes; the guard keeps them from re-running this script's body.
    main()
