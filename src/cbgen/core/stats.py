"""Engine counters: one cumulative record, and one record per step.

The scheduler, the block manager and the engine add to the same :class:`EngineStats` object, so no
counter is kept twice and copied between layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Cumulative counters of one engine (see the README for their meanings)."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of added requests (a group's prompt counted once)
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    prefix_cache_resets: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    weight_changes: int = 0
    batched_seqs: int = 0  # sequences summed over steps
    times: dict[str, float] = field(default_factory=dict)  # seconds per step phase, summed

    @property
    def mean_batch_size(self) -> float:
        """Average sequences per step."""
        return self.batched_seqs / self.steps if self.steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class StepStats:
    """What one step did; passed to ``on_step`` callbacks."""

    step: int
    num_seqs: int
    num_tokens: int
    num_decode: int
    num_prefill_tokens: int
    num_sampled: int
    preempted: int
    running: int
    waiting: int
    kv_usage: float
    times: dict[str, float] = field(default_factory=dict)
    threads: int = 0  # torch threads the step ran on (fewer than the user's while others hold cores)
