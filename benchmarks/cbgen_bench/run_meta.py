"""The report's ``meta`` block: when, where and with what the benchmark ran."""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

from cbgen_bench.engine_settings import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

# Settings that change how torch's thread pool behaves; recorded because they move results a lot.
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "LD_PRELOAD")


def loadavg() -> float | None:
    """The one-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The ``meta`` block for a run of ``cbgen bench`` with ``argv`` (parsed as ``args``)."""
    import torch
    import transformers

    from cbgen.utils import resolve_device

    device = resolve_device(args.device)
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    except OSError:
        pass
    # The flags that decide which kernels exist here: numbers from one CPU do not carry to another.
    cpu_features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return {
        "cpu_features": cpu_features,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": argv,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "tiny": args.tiny,
        "isolated": not args.no_isolate,
        "cold_start": args.cold_start,
        "cold_repeats": args.cold_repeats if args.cold_start else None,
        "no_check": bool(getattr(args, "no_check", False)),
        "neighbour": getattr(args, "neighbour", None),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "loadavg_start": loadavg(),
    }


__all__ = ["THREAD_ENV", "loadavg", "run_meta"]
