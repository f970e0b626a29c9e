"""Result objects handed to users: one ``RequestOutput`` per request, one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sample of a request.

    ``token_logprobs`` are log-probabilities under the *processed* distribution actually sampled from
    (penalties, temperature and truncation applied, renormalised; 0.0 for greedy). ``raw_logprobs`` are
    ``log_softmax`` of the raw model logits at temperature 1, which is what a trainer recomputes.
    ``log_kept_mass`` is the log of the temperature-1 probability mass of the tokens that survived
    truncation. With temperature 1 and no penalties: ``logprob == raw_logprob - log_kept_mass``.

    ``kept_counts`` / ``kept_thresholds`` are the behaviour-policy record of each token's kept set:
    top-k, top-p and min-p keep the tokens whose processed logit (before temperature) is at least the
    threshold, and the count says how many that was (0 and ``-inf``: no truncation, every token; a
    greedy token: 1 and the largest logit).  :func:`cbgen.processed_logprobs` turns the trainer's
    logits, the request's ``SamplingParams`` and the counts into the processed logprobs under the
    same truncation (equal to ``token_logprobs`` bit for bit in parity mode).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    log_kept_mass: list[float] = field(default_factory=list)
    kept_counts: list[int] = field(default_factory=list)
    kept_thresholds: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the matched stop string or stop token id

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the processed logprobs of the sampled tokens."""
        return float(sum(self.token_logprobs))

    def finished(self) -> bool:
        """True once this sample has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` samples.

    ``weight_version`` is the engine's count of observed weight changes at the time the request
    was (re)computed, so rollouts can be matched to the policy that produced them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    weight_version: int = 0
    error: str | None = None
    num_cached_tokens: int = 0
