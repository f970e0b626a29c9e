"""The ``vllm`` runner: :mod:`cbgen_bench.vllm_runner` under the interpreter of a vLLM virtualenv.

vLLM is never imported here; the runner script gets a JSON spec and writes its results as JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cbgen_bench.engine_result import EngineResult, RunRecord
from cbgen_bench.engine_settings import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, BenchOptions
from cbgen_bench.lifetime import run_child
from cbgen_bench.workloads import Workload

# vLLM's CPU attention rejects smaller heads ("Unsupported CPU attention configuration").
VLLM_MIN_HEAD_DIM = 32
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_unsupported_reason(model: Any) -> str | None:
    """Why vLLM's CPU build cannot run ``model`` (None if it can)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim < VLLM_MIN_HEAD_DIM:
        return f"vLLM CPU attention needs head_dim >= {VLLM_MIN_HEAD_DIM}; this model has {head_dim}"
    return None


def vllm_spec(folder: str, workload: Workload, opts: BenchOptions) -> dict[str, Any]:
    """The JSON spec :mod:`cbgen_bench.vllm_runner` reads for ``workload`` on the model in ``folder``."""
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
    """vLLM in ``opts.vllm_python`` (its own virtualenv) running :mod:`cbgen_bench.vllm_runner`."""
    spec = vllm_spec(folder, workload, opts)
    with tempfile.TemporaryDirectory(prefix="cbgen-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = run_child(
            [opts.vllm_python, str(VLLM_RUNNER), "--spec", str(spec_path), "--out", str(out_path)],
            env=vllm_env(),
            check=False,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vllm_runner exited with status {proc.returncode}")
        data = json.loads(out_path.read_text())
    result = EngineResult("vllm", workload.name, isolated=True, settings=data.get("settings", {}))
    result.runs = [
        RunRecord(r["wall_s"], r["output_tokens"], r.get("ttft_s"), tokens=r.get("tokens"))
        for r in data["runs"]
    ]
    result.tokens = data["tokens"]
    result.peak_memory_bytes = data.get("peak_rss_bytes")
    result.notes.extend(data.get("notes", []))
    return result


__all__ = ["VLLM_RUNNER", "run_vllm", "vllm_env", "vllm_spec", "vllm_unsupported_reason"]
