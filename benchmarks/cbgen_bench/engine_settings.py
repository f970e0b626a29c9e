"""Settings every engine runner shares: the engine names, the batching limits and :class:`BenchOptions`.

Every engine gets the same KV capacity (enough for the whole workload at once), the same per-step
token budget (2,048) and the same sequence cap (256).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbgen_bench.workloads import Workload

ENGINE_NAMES: tuple[str, ...] = (
    "cbgen",
    "cbgen-compile",
    "cbgen-noshare",
    "cbgen-parity",
    "hf-generate",
    "hf-cb",
    "vllm",
)
BASELINES: tuple[str, ...] = ("hf-generate", "hf-cb", "vllm", "cbgen-noshare")
REFERENCE_ENGINE = "hf-generate"

MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
BLOCK_SIZE = 16


@dataclass
class BenchOptions:
    """Settings shared by every runner."""

    repeats: int = 3
    dtype: str = "float32"
    device: str | None = None
    batch_size: int = 0  # hf-generate; 0 = all prompts in one batch
    profile: bool = False
    tiny: bool = False
    scale: float = 1.0  # share of the chat/grpo prompts to run (models too slow for the full set)
    vllm_python: str | None = None
    model: str | None = None  # overrides every workload's model key


def kv_blocks_needed(workload: Workload, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold every sequence of the workload at once (prefix sharing not assumed)."""
    per_request = [-(-(len(p) + m + 1) // block_size) for p, m in zip(workload.prompts, workload.max_tokens)]
    return sum(per_request) * workload.n + 16


__all__ = [
    "BASELINES",
    "BLOCK_SIZE",
    "ENGINE_NAMES",
    "MAX_NUM_BATCHED_TOKENS",
    "MAX_NUM_SEQS",
    "REFERENCE_ENGINE",
    "BenchOptions",
    "kv_blocks_needed",
]
