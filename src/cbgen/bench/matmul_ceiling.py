"""The matmul ceiling: measured ``F.linear`` throughput at a model's decode and prefill shapes.

It bounds how fast any engine can run a workload on this machine, so the report can say how close
each engine gets to it.
"""

from __future__ import annotations

import time
from typing import Any

from cbgen.bench.runner_common import sync


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
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
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


def best_ceiling(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per dtype and shape, the higher of two :func:`matmul_ceiling` measurements."""
    out = dict(a)
    for dtype in ("float32", "bfloat16"):
        out[dtype] = {k: max(a[dtype][k], b[dtype][k]) for k in a[dtype]}
    return out


__all__ = ["best_ceiling", "matmul_ceiling", "time_matmuls"]
