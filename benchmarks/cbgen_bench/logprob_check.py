"""The check of sampled workloads: each run's tokens against a plain forward of the model, on a sample
of its sequences.

Sampled tokens cannot be compared across engines, but they can be held to the model that produced
them.  For each checked sequence one forward over prompt + tokens gives, at every generated position,
the distribution the engine should have sampled from (``softmax(logits / temperature)``; every engine
samples the full distribution here).  Two checks follow:

* the engine's own ``raw_logprobs`` (cbgen reports them) equal ``log_softmax`` of the forward's logits
  at the sampled token: to 1e-4 in float32 (what the README promises), in bfloat16 to 8 ulps of the
  row's largest logit (two bf16 computations round differently; the derivation is in
  ``tests/oracle.py``, ``bf16_tolerance``);
* the tokens are draws from those distributions, for every engine: the sum over positions of
  ``log q(token) + H(q)`` has mean 0 and variance ``sum Var[log q]`` under correct sampling (a
  martingale, so positions that depend on earlier draws still add up), and its z-score must stay
  within :data:`MAX_Z`.  Sampling at the wrong temperature or from a stale model moves it by many
  standard deviations over a few hundred tokens.
"""

from __future__ import annotations

import math
from typing import Any

from cbgen_bench.engine_result import EngineResult
from cbgen_bench.workloads import Workload

SEQUENCES = 8
FP32_TOLERANCE = 1e-4
BF16_ULPS = 8
# A correct sampler exceeds it with probability ~6e-7 per check.
MAX_Z = 5.0


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7) if x > 0 and math.isfinite(x) else 0.0


def _chosen(workload: Workload, count: int) -> list[tuple[int, int]]:
    """Up to ``count`` (request, sample) pairs spread evenly over the workload's sequences."""
    total = workload.num_sequences
    picks = sorted({k * total // count for k in range(count)}) if total > count else range(total)
    return [(k // workload.n, k % workload.n) for k in picks]


def _sequence_stats(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> dict[str, Any]:
    """The forward's raw logprobs of ``tokens``, each row's bf16 ulp scale, and the z-test sums."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1 : -1]
    logits = logits.double().cpu()
    ids = torch.tensor(tokens)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, ids)[:, 0]
    logq = torch.log_softmax(logits / temperature, -1)
    q = logq.exp()
    entropy = -(q * logq).sum(-1)
    var = (q * logq.square()).sum(-1) - entropy.square()
    return {
        "raw": raw.tolist(),
        "scale": logits.abs().amax(-1).tolist(),
        "centred": float((logq.gather(1, ids)[:, 0] + entropy).sum()),
        "var": float(var.clamp_min(0).sum()),
    }


def check_run(
    model: Any, workload: Workload, tokens: list, raw_logprobs: list | None, dtype: str
) -> dict[str, Any]:
    """One run's check (module docstring): sequences and tokens checked, the largest raw-logprob
    difference and its share of the tolerance (None when the engine reports no logprobs), the
    z-score, and ``ok``."""
    checked = centred = var = 0.0
    worst = share = None
    chosen = _chosen(workload, SEQUENCES)
    for i, j in chosen:
        stats = _sequence_stats(model, workload.prompts[i], tokens[i][j], workload.temperature)
        checked += len(tokens[i][j])
        centred += stats["centred"]
        var += stats["var"]
        if raw_logprobs is None:
            continue
        for got, want, scale in zip(raw_logprobs[i][j], stats["raw"], stats["scale"], strict=True):
            tol = FP32_TOLERANCE if dtype == "float32" else BF16_ULPS * _bf16_ulp(scale)
            diff = abs(got - want)
            worst = diff if worst is None else max(worst, diff)
            share = diff / tol if share is None else max(share, diff / tol)
    z = centred / math.sqrt(var) if var > 0 else 0.0
    return {
        "sequences": len(chosen),
        "tokens": int(checked),
        "max_raw_logprob_diff": worst,
        "share_of_tolerance": share,
        "tolerance": FP32_TOLERANCE if dtype == "float32" else f"{BF16_ULPS} bf16 ulps of the largest logit",
        "z": z,
        "ok": abs(z) <= MAX_Z and (share is None or share <= 1.0),
    }


def check_sampled(model: Any, workload: Workload, results: dict[str, EngineResult], dtype: str) -> None:
    """Fills ``sample_checks`` of every engine that ran a sampled ``workload``, one entry per run."""
    if workload.greedy:
        return
    for result in results.values():
        if result.error or not result.runs or any(run.tokens is None for run in result.runs):
            continue
        result.sample_checks = [
            check_run(model, workload, run.tokens, run.raw_logprobs, dtype) for run in result.runs
        ]


def check_cold(model: Any, workload: Workload, cold: dict[str, Any], dtype: str) -> None:
    """Fills ``sample_checks`` of each cold-start result of a sampled ``workload`` (token draws only:
    the cold children report no logprobs)."""
    if workload.greedy:
        return
    for result in cold.values():
        if result.runs and all(run.tokens is not None for run in result.runs):
            result.sample_checks = [
                check_run(model, workload, run.tokens, None, dtype) for run in result.runs
            ]


__all__ = ["MAX_Z", "check_cold", "check_run", "check_sampled"]
