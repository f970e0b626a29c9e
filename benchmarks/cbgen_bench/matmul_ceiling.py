"""The matmul ceiling: the best measured GEMM throughput at a model's decode and prefill shapes.

It bounds how fast any engine can run a workload on this machine, so the report can say how close
each engine gets to it.  To be a bound it must be the *best* this machine does: every GEMM the
engine itself can choose from (plain ``F.linear``, MKL's and oneDNN's packed GEMMs, our AMX, gemv and panel kernels;
:mod:`cbgen.model.cpu_fast.gemm_choice`) is timed, with weights cold as in a real step (several distinct
copies cycled, more bytes than the caches hold), and the fastest counts; the report names it.  An
engine that still reads above 100% means the ceiling missed a faster GEMM, and the report says so.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from cbgen_bench.runner_common import sync

# Distinct weight copies cycled per timing: at least this many bytes, so each pass reads them from
# memory, as a decode step does.
COLD_BYTES = 96 << 20


def time_matmuls(
    shapes: list[tuple[int, int]],
    rows: int,
    dtype: str,
    device: Any = None,
    budget_s: float = 0.2,
    candidate: Any = None,
    cold_bytes: int = COLD_BYTES,
) -> float | None:
    """GFLOP/s of one GEMM (``candidate``, a :class:`cbgen.model.cpu_fast.gemm_choice.Candidate`; default
    ``F.linear``) over ``shapes`` ((in, out) weights) with ``rows`` input rows, cycling through
    enough copies of the weights to keep them out of cache: the median of three timed batches, each
    sized to take at least ``budget_s / 12``.  None when the candidate does not serve ``rows``."""
    import torch

    from cbgen.model.cpu_fast.gemm_choice import PLAIN
    from cbgen.utils import resolve_dtype

    cand = candidate or PLAIN
    dt = resolve_dtype(dtype, None, device or "cpu")
    dev = torch.device(device or "cpu")
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(o, i, generator=g).to(dtype=dt, device=dev) for i, o in shapes]
    layer_bytes = sum(w.numel() * w.element_size() for w in base)
    copies = max(1, cold_bytes // max(layer_bytes, 1)) if dev.type == "cpu" else 1
    weights = [w if c == 0 else w.clone() for c in range(copies) for w in base]
    packed = [(cand.pack(w) if cand.pack is not None else None, w) for w in weights]
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype=dt, device=dev) for i, _ in shapes}
    flops = sum(2 * rows * i * o for i, o in shapes) * copies
    with torch.inference_mode():
        if any(cand.apply(inputs[w.shape[1]], p, w, None) is None for p, w in packed[: len(base)]):
            return None

    def once(reps: int) -> float:
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                for p, w in packed:
                    cand.apply(inputs[w.shape[1]], p, w, None)
        sync(dev)
        return time.perf_counter() - t0

    # Calibrate by doubling rather than from one probe: a single fast probe on a busy machine
    # would otherwise ask for far more repetitions than the budget allows.
    once(1)
    reps = 1
    while once(reps) < budget_s / 12 and reps < 1 << 16:
        reps *= 2
    seconds = statistics.median(once(reps) / reps for _ in range(3))
    return flops / seconds / 1e9


def best_gemm(
    shapes: list[tuple[int, int]], rows: int, dtype: str, device: Any, budget_s: float, cold_bytes: int
) -> dict[str, Any]:
    """The fastest GEMM candidate for ``rows`` rows through ``shapes`` in ``dtype``:
    ``{"gflops", "gemm" (its name), "all" (every candidate's GFLOP/s, None if it does not serve)}``."""
    import torch

    from cbgen.model.cpu_fast.gemm_choice import PLAIN, candidates
    from cbgen.utils import resolve_dtype

    dt = resolve_dtype(dtype, None, device or "cpu")
    found = candidates(dt) if torch.device(device or "cpu").type == "cpu" else {"plain": PLAIN}
    rates = {
        name: time_matmuls(shapes, rows, dtype, device, budget_s, cand, cold_bytes)
        for name, cand in found.items()
    }
    usable = {k: v for k, v in rates.items() if v is not None}
    winner = max(usable, key=usable.get)
    return {"gflops": usable[winner], "gemm": winner, "all": rates}


def matmul_ceiling(
    dims: Any,
    decode_rows: int,
    prefill_rows: int,
    device: Any = None,
    budget_s: float = 0.2,
    cold_bytes: int = COLD_BYTES,
) -> dict[str, Any]:
    """Best measured GEMM throughput at the model's decode shapes (``decode_rows`` rows through one
    layer's matmuls plus the LM head) and prefill shapes (``prefill_rows`` rows, no LM head), for
    float32 and bfloat16, with the winning GEMM of each.  ``cold_bytes``: the weight copies cycled
    through (smaller is quicker and warmer; the tests' tiny runs use one copy)."""
    out: dict[str, Any] = {"decode_rows": decode_rows, "prefill_rows": prefill_rows}
    decode_shapes = [*dims.layer_linears, (dims.hidden_size, dims.vocab_size)]
    for dtype in ("float32", "bfloat16"):
        decode = best_gemm(decode_shapes, decode_rows, dtype, device, budget_s, cold_bytes)
        prefill = best_gemm(dims.layer_linears, prefill_rows, dtype, device, budget_s, cold_bytes)
        out[dtype] = {
            "decode_gflops": decode["gflops"],
            "prefill_gflops": prefill["gflops"],
            "decode_gemm": decode["gemm"],
            "prefill_gemm": prefill["gemm"],
            "candidates": {"decode": decode["all"], "prefill": prefill["all"]},
        }
    return out


def best_ceiling(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per dtype and shape, the higher of two :func:`matmul_ceiling` measurements (and its GEMM)."""
    out = dict(a)
    for dtype in ("float32", "bfloat16"):
        merged = dict(a[dtype])
        for kind in ("decode", "prefill"):
            if b[dtype][f"{kind}_gflops"] > a[dtype][f"{kind}_gflops"]:
                merged[f"{kind}_gflops"] = b[dtype][f"{kind}_gflops"]
                merged[f"{kind}_gemm"] = b[dtype][f"{kind}_gemm"]
        out[dtype] = merged
    return out


__all__ = ["best_ceiling", "best_gemm", "matmul_ceiling", "time_matmuls"]
