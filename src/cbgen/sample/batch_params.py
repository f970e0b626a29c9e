"""Per-batch sampling settings, gathered from the requests in one pass, and seeded uniforms.

One O(B) Python pass over the requests (:meth:`BatchParams.from_requests`) turns per-request
settings into flat lists and tensors; everything after that is batched tensor math with no
per-row Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cbgen.request import Request
from cbgen.sample.row_ops import NEG_INF


def _uniform_from_hash(seed: int, sample_index: int, position: int) -> float:
    """Counter-based uniform in (0, 1) from splitmix64; depends on nothing but its three inputs."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    h = mix(seed & mask)
    h = mix(h ^ (sample_index & mask))
    h = mix(h ^ (position & mask))
    # 53 random bits centred in their cell: never exactly 0 or 1.
    return ((h >> 11) + 0.5) / float(1 << 53)


def seeded_uniform(seed: int, sample_index: int, position: int) -> float:
    """The uniform a seeded request uses for output position ``position`` of sample ``sample_index``.

    It is a pure function of its arguments, so a seeded sample does not depend on the batch it
    is scheduled in, on its row, on preemption or on anything else in the process.
    """
    return _uniform_from_hash(seed, sample_index, position)


@dataclass
class BatchParams:
    """Per-row sampling settings of one batch, gathered in a single pass over the requests.

    Row lists are plain Python lists (cheap to build, turned into tensors once by the caller);
    per-row scalars are CPU tensors of length ``num_rows``.  ``modified[i]`` says the processed
    logits of row ``i`` may differ from the raw ones; ``masked[i]`` that stage 0/1 may have set
    some of them to ``-inf`` (custom processors, ``min_tokens``, a ``-inf`` logit bias, structured
    output).
    """

    num_rows: int
    vocab_size: int
    greedy_rows: list[int] = field(default_factory=list)
    sampled_rows: list[int] = field(default_factory=list)
    truncated_rows: list[int] = field(default_factory=list)  # sampled rows with top-k/top-p/min-p
    temperature: torch.Tensor | None = None  # float32 [B]; 1.0 for greedy rows
    top_k: torch.Tensor | None = None  # int64 [B]; 0 = off
    top_p: torch.Tensor | None = None  # float64 [B]; 1.0 = off
    min_p: torch.Tensor | None = None  # float32 [B]; 0.0 = off
    repetition_rows: list[int] = field(default_factory=list)
    repetition_penalty: list[float] = field(default_factory=list)
    freq_pres_rows: list[int] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    presence_penalty: list[float] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_cols: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    banned_rows: list[int] = field(default_factory=list)
    banned_cols: list[int] = field(default_factory=list)
    processor_rows: dict[str, list[int]] = field(default_factory=dict)
    processor_args: dict[str, list[Any]] = field(default_factory=dict)
    structured_rows: list[int] = field(default_factory=list)  # rows with SamplingParams.structured_output
    modified: list[bool] = field(default_factory=list)
    masked: list[bool] = field(default_factory=list)
    identity: list[bool] = field(default_factory=list)  # sampled, unmodified, temperature 1
    seeded_rows: list[int] = field(default_factory=list)
    seeded_u: list[float] = field(default_factory=list)
    unseeded_rows: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    num_top_logprobs: int = 0
    any_temperature: bool = False
    any_truncation: bool = False

    @property
    def any_modified(self) -> bool:
        """True when stage 0/1 changes at least one row (the sampler then needs a private copy)."""
        return any(self.modified)

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int) -> BatchParams:
        """Reads every request once; ``vocab_size`` is the logits width (ids at or above it are ignored)."""
        n = len(requests)
        out = cls(num_rows=n, vocab_size=vocab_size)
        # Rows start as plain greedy rows (the common case, kept to a few attribute reads per row:
        # this runs every step for every running request); other rows overwrite their entries.
        temperature, top_k, top_p, min_p = [1.0] * n, [0] * n, [1.0] * n, [0.0] * n
        out.modified, out.masked, out.identity = [False] * n, [False] * n, [False] * n
        for i, req in enumerate(requests):
            p = req.params
            greedy = p.temperature == 0.0
            if (
                greedy
                and p.repetition_penalty == 1.0
                and not p.frequency_penalty
                and not p.presence_penalty
                and not p.logit_bias
                and not p.logits_processor_args
                and p.structured_output is None
                and p.logprobs is None
                and req.num_output_tokens >= p.min_tokens
            ):
                out.greedy_rows.append(i)
                continue
            modified = masked = False
            if greedy:
                out.greedy_rows.append(i)
            else:
                out.sampled_rows.append(i)
                t = float(p.temperature)
                temperature[i] = t
                out.any_temperature |= t != 1.0
                k = p.top_k if 0 < p.top_k < vocab_size else 0
                top_k[i] = k
                top_p[i], min_p[i] = float(p.top_p), float(p.min_p)
                if k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                    out.truncated_rows.append(i)
                if p.seed is not None:
                    out.seeded_rows.append(i)
                    out.seeded_u.append(_uniform_from_hash(p.seed, req.sample_index, req.num_output_tokens))
                else:
                    out.unseeded_rows.append(i)
            if p.repetition_penalty != 1.0:
                out.repetition_rows.append(i)
                out.repetition_penalty.append(float(p.repetition_penalty))
                modified = True
            if (p.frequency_penalty or p.presence_penalty) and req.num_output_tokens > 0:
                out.freq_pres_rows.append(i)
                out.frequency_penalty.append(float(p.frequency_penalty))
                out.presence_penalty.append(float(p.presence_penalty))
                modified = True
            if p.logit_bias or req.num_output_tokens < p.min_tokens:
                biased, banned = out._add_bias_and_bans(i, req, vocab_size)
                modified |= biased or banned
                masked |= banned
            if p.logits_processor_args:
                for name, arg in p.logits_processor_args.items():
                    out.processor_rows.setdefault(name, []).append(i)
                    out.processor_args.setdefault(name, []).append(arg)
                    modified = masked = True
            if p.structured_output is not None:
                out.structured_rows.append(i)
                modified = masked = True
            if p.logprobs is not None:
                out.logprob_rows.append(i)
                out.num_top_logprobs = max(out.num_top_logprobs, p.logprobs)
            out.modified[i], out.masked[i] = modified, masked
            out.identity[i] = not greedy and not modified and p.temperature == 1.0
        out._finish(temperature, top_k, top_p, min_p)
        return out

    def _add_bias_and_bans(self, i: int, req: Request, vocab_size: int) -> tuple[bool, bool]:
        """Row ``i``'s logit bias, and the tokens ``min_tokens`` bans (EOS and stop tokens while too
        few tokens were generated); returns (changed anything, set anything to -inf)."""
        p = req.params
        modified = masked = False
        for token, bias in (p.logit_bias or {}).items():
            if 0 <= token < vocab_size and bias != 0.0:
                self.bias_rows.append(i)
                self.bias_cols.append(token)
                self.bias_values.append(bias)
                modified = True
                masked |= bias == NEG_INF
        if req.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned |= req.eos_token_ids
            for token in banned:
                if 0 <= token < vocab_size:
                    self.banned_rows.append(i)
                    self.banned_cols.append(token)
                    modified = masked = True
        return modified, masked

    def _finish(
        self, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
    ) -> None:
        # The per-row pass writes plain list elements (cheap); the tensors are built once, here.
        self.any_truncation = bool(self.truncated_rows)
        self.temperature = torch.tensor(temperature, dtype=torch.float32)
        self.top_k = torch.tensor(top_k, dtype=torch.int64)
        self.top_p = torch.tensor(top_p, dtype=torch.float64)
        self.min_p = torch.tensor(min_p, dtype=torch.float32)

    def uniforms(self, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Each row's uniform in float64 on ``device``: hashed for seeded rows, drawn from
        ``generator`` for unseeded sampled rows, 0 for greedy rows."""
        u = torch.zeros(self.num_rows, dtype=torch.float64)
        if self.seeded_rows:
            u[torch.tensor(self.seeded_rows)] = torch.tensor(self.seeded_u, dtype=torch.float64)
        if self.unseeded_rows:
            n = len(self.unseeded_rows)
            u[torch.tensor(self.unseeded_rows)] = torch.rand(n, generator=generator, dtype=torch.float64)
        return u.to(device)


__all__ = ["BatchParams", "seeded_uniform"]
